"""Which cached block leaves first, in memory and on disk: recency, hits and the cost to
compute it again, weighed together (GreedyDual-Size-Frequency, as web caches and LMCache's
cost-aware policies do).

A block's worth is what losing it costs: reading its tokens again, each attending to every
position before it, so a block deep in a long session costs more than the first blocks of a
short chat (cost ∝ its position in the chain), times one plus the lookups it served. Its
priority is the cache's clock when it was last used plus that worth; the lowest priority
leaves first, and the clock rises to each evicted block's priority, so a block not used for
long enough loses to fresh ones however dear it was (recency). Only leaves are evicted (a
chain never loses a block its descendants need): the callers pick among leaves."""

from __future__ import annotations

from dataclasses import dataclass


def worth(end: int, hits: int) -> float:
    """What losing a block ending at position `end` costs (in tokens read at a chain's first
    position): its position in the chain, times one plus the lookups it served."""
    return float(max(1, end) * (1 + max(0, hits)))


@dataclass
class Clock:
    value: float = 0.0

    def priority(self, end: int, hits: int) -> float:
        """The priority of a block used now."""
        return self.value + worth(end, hits)

    def evicted(self, priority: float) -> None:
        self.value = max(self.value, priority)
