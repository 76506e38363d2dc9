"""`mlxgw launch CLIENT`: point an agent client at the gateway and start it.

probe.py finds the server, the model, its context and prefill rate, and a key; each client
module turns those facts into a `Plan` (environment, config-file edits, argv); core.py
merges config files without losing the user's other settings (a backup and a diff) and
execs the client; cli.py is the click command."""
