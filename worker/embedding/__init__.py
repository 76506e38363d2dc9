"""Embedding and reranking workers: an MLX encoder plus a scheduler that batches inputs."""
