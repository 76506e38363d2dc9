"""The HTTP side of mlxgw: one asyncio process; never imports MLX."""
