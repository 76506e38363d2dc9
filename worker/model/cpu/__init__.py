"""Kernels and settings for MLX's CPU backend: attention, the output head, BLAS threads."""
