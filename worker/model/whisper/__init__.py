"""Whisper (speech to text) on MLX: the model, its tokenizer, decoding and word timings."""
