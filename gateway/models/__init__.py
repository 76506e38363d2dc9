"""Models and their workers: slots, loading and residency, supervision, generations on a worker,
metrics. Imports link, web."""
