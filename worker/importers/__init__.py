"""Model folders from elsewhere: GGUF files, Hugging Face folders and the hub, Whisper checkpoints.
Imports model, text."""
