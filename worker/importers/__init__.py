"""Model folders from elsewhere: GGUF files, Hugging Face folders and the hub, Whisper checkpoints, Piper voices.
Imports model, text."""
