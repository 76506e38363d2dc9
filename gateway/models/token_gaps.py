"""Inter-token gaps per stream, counted into Prometheus buckets: kept by each request
(gateway/models/generation.py) and merged into its model's series when it ends
(gateway/models/metrics.py), which imports the request's type, so this sits below both."""

from __future__ import annotations

from bisect import bisect_left

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)


class GapHistogram:
    """Inter-token gaps counted into ITL_BUCKETS (Prometheus' `le` buckets) with their sum.
    A stream adds each gap with one bisect into its own counts, merged into the model's once
    when the request ends: a prometheus_client Histogram would take a lock and walk the
    buckets in Python for every token."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(ITL_BUCKETS) + 1)  # the last one: +Inf
        self.total = 0.0

    def add(self, gap: float, n: int = 1) -> None:
        self.counts[bisect_left(ITL_BUCKETS, gap)] += n
        self.total += gap * n

    def merge(self, other: GapHistogram) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.total += other.total
