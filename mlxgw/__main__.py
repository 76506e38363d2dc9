"""`python -m mlxgw` is the `mlxgw` command."""

from mlxgw.cli import main

main()
