"""The gateway's command-line commands (up, reload, status, keys, usage, audit, service, launch).

They are clients of a running server or edit its files; the server imports nothing from here."""
