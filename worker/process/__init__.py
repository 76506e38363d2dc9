"""The worker process: its entry, the engine loop, the ZeroMQ link, sharded ranks. Imports
schedule, importers, model, text."""
