"""Text to image and image edits: mlx-vlm's image models on a thread of their own."""
