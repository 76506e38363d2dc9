"""what a row costs: the KV budget and capacity."""
