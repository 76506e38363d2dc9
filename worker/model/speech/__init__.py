"""Text to speech: the Piper voice runner (ONNX, not MLX)."""
