"""The Files and Batch APIs underneath: stored files, batch jobs in SQLite, the runner that replays
lines. Imports pipeline and below."""
