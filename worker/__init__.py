"""The MLX side of mlxgw: one process per model. The gateway never imports this package."""
