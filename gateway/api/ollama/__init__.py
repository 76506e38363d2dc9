"""Ollama's API: chat and generate, model listing and management, Modelfiles."""
