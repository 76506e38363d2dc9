"""Import GGUF files (llama.cpp, Ollama, LM Studio) into MLX model folders that mlx_lm.load() reads."""

from .importer import ImportError_, ImportResult, import_gguf

__all__ = ["ImportError_", "ImportResult", "import_gguf"]
