"""`python -m worker` / `mlxgw worker`: serve one model over the gateway link."""

from .main import main

main()
