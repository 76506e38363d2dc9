"""mlxgw's own control routes: keys and usage, adapters, status and caches."""
