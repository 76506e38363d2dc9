"""Requests through their lifecycle: intake, admission, fair share, sequences and what they emit.
Imports model, text."""
