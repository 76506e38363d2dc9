"""`python -m mlxgw.worker`: how the gateway starts a worker (the same as `mlxgw worker`)."""

from .process.cli import worker

worker(prog_name="mlxgw worker")
