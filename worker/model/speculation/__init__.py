"""Speculative decoding inside continuous batching: drafting, verification, draft models."""
