"""Embedding and reranking encoders on MLX (BERT family)."""
