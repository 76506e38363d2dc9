"""Every summary a bench prints, in one place: percentiles, a true median, a mean with its
spread, and the spread test that flags a run whose rounds disagree.

Why one module: bench/serving/peers.py's agent table once took `sorted(values)[len(values) // 2]`
as its median, which for two rounds is the upper one (7.96 and 16.71 chunks/s were reported
as 16.7); a copy of a statistic in each bench is a copy of its bugs. Pure Python, no numpy,
so the gateway-side benches import it too."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


def _clean(values: Iterable[float | None]) -> list[float]:
    """The values that exist: a round that produced no figure is left out, not counted as 0."""
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated between the closest ranks (numpy's
    default); None for no values."""
    ordered = sorted(_clean(values))
    if not ordered:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    k = (len(ordered) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Iterable[float | None]) -> float | None:
    """The median: the middle value, or the mean of the two middle ones for an even count."""
    return percentile(values, 50)


def mean(values: Iterable[float | None]) -> float | None:
    clean = _clean(values)
    return statistics.fmean(clean) if clean else None


def stdev(values: Iterable[float | None]) -> float | None:
    """Sample standard deviation; None below two values (one round has no spread to show)."""
    clean = _clean(values)
    return statistics.stdev(clean) if len(clean) >= 2 else None


def relative_spread(values: Iterable[float | None]) -> float | None:
    """(max - min) / median: how far apart the rounds are, as a share of the figure. None
    below two values or when the median is 0 (no scale to compare with)."""
    clean = _clean(values)
    mid = median(clean)
    if len(clean) < 2 or not mid:
        return None
    return (max(clean) - min(clean)) / abs(mid)


@dataclass(frozen=True)
class Summary:
    """One figure over its rounds: the rounds themselves and what they say together."""

    rounds: tuple[float, ...]
    median: float | None
    mean: float | None
    stdev: float | None
    low: float | None
    high: float | None
    spread: float | None  # relative: (high - low) / median

    def unstable(self, max_spread: float | None) -> bool:
        """Rounds that disagree by more than max_spread (a fraction; None: never flagged)."""
        return max_spread is not None and self.spread is not None and self.spread > max_spread

    def as_dict(self, digits: int = 4) -> dict:
        out = asdict(self)
        return {k: _round(v, digits) for k, v in out.items()}

    def cell(self, digits: int = 2) -> str:
        """'59.1 (58.0, 60.3, 61.2)': the median and every round beside it."""
        if self.median is None:
            return ""
        head = _fmt(self.median, digits)
        if len(self.rounds) < 2:
            return head
        return f"{head} ({', '.join(_fmt(v, digits) for v in self.rounds)})"


def summarize(values: Sequence[float | None]) -> Summary:
    """The rounds of one figure, in the order they ran (None rounds dropped)."""
    clean = _clean(values)
    return Summary(
        rounds=tuple(clean),
        median=median(clean),
        mean=mean(clean),
        stdev=stdev(clean),
        low=min(clean) if clean else None,
        high=max(clean) if clean else None,
        spread=relative_spread(clean),
    )


def paired_ratios(ours: Sequence[float | None], theirs: Sequence[float | None]) -> list[float | None]:
    """ours[i] / theirs[i] per round: both ran back to back in the same round, so the ratio
    of a pair cancels what drifted between rounds (a ratio of two medians does not)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} rounds against {len(theirs)}: pair rounds one to one")
    return [a / b if a is not None and b else None for a, b in zip(ours, theirs)]


def _fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _round(value, digits: int):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, tuple):
        return [_round(v, digits) for v in value]
    return value
