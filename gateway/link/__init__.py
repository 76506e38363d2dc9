"""The gateway's end of the ZeroMQ link: the broker, its worker records, wire checks, liveness,
quarantine. Imports web."""
