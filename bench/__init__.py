"""`mlxgw bench`: an OpenAI-compatible load generator, and the in-process baseline."""
