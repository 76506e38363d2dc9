"""What a speculative step costs and what it should be worth, learned from the steps
themselves (worker/speculative.py decides with it; nothing here touches a model).

- CostMeter: seconds and emitted tokens of one kind of step (plain or speculative) at one
  batch-size bucket, exponentially averaged; the end-to-end comparison that pauses
  speculation when it loses.
- WidthCost: what each verified position beyond a row's first costs at a bucket. A
  verification is one rectangle, rows x (1 + the longest draft) (worker/spec_verify.py):
  on a GPU at small batches the extra positions are nearly free, on a CPU a width-5
  verification at batch 16 costs 2.6x a plain step (bench/verify_width.py). The slope is a
  least-squares fit through the origin of a speculative step's time above the plain step's
  against its extra positions, so it is measured on the host it runs on, not assumed.
- Acceptance: how likely a drafted token is accepted once the one before it was (the
  accepted positions against the rejections, a geometric model), for all rows and per row.
- Calibration: what verifications emitted beyond one token a row against what the model
  expected of them.
- choose_width: from the drafts in hand, each row's acceptance (calibrated), the plain
  step's cost and the width's slope, the verification width with the most expected tokens
  per second; 1 (a plain step) unless a verification is expected to beat it by WIDTH_MARGIN. At c = 16 on
  this CPU a few rows with short drafts made every row pay a wide verification (0.91x); the
  width now has to pay for itself before a step is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAMPLES = 8  # steps of each kind before the end-to-end comparison is trusted
EMA = 0.9  # weight of the past in the cost averages
GAP = 10.0  # a step timed at over GAP x its kind's average spanned an idle gap: not a sample
WIDTH_MARGIN = 1.1  # a verification must promise this x a plain step's tokens per second
ACCEPTANCE_PRIOR = (0.5, 2.0)  # (rate, pseudo-positions) before anything is observed
ACCEPTANCE_DECAY = 0.995  # per step: old evidence fades, so a changed workload is tried again
ROW_PRIOR = 2.0  # pseudo-positions of the model-wide rate in a row's own estimate
CALIBRATION_PRIOR = 1.0  # extra tokens a verification is taken to have expected and emitted


def size_bucket(rows: int) -> int:
    """Batch sizes share meters by powers of two: at c = 32 the batch passes through every
    size as rows finish and arrive, and a meter per size needing MIN_SAMPLES steps of each
    kind kept speculation in its learning phase for a whole wave (0.45x at c = 32)."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class CostMeter:
    """Seconds and emitted tokens, exponentially averaged, for one kind of step."""

    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0

    def add(self, seconds: float, tokens: int) -> bool:
        """Whether the step counted (one that spanned an idle gap does not)."""
        if self.samples >= MIN_SAMPLES and seconds > GAP * self.seconds / (1 - EMA**self.samples):
            return False  # the batch went idle (or only read prompts) after this step (the EMA starts at 0)
        self.seconds = EMA * self.seconds + (1 - EMA) * seconds
        self.tokens = EMA * self.tokens + (1 - EMA) * tokens
        self.samples += 1
        return True

    def per_token(self, min_samples: int = MIN_SAMPLES) -> float | None:
        return self.seconds / self.tokens if self.samples >= min_samples and self.tokens > 0 else None


@dataclass
class WidthCost:
    """Seconds per verified position beyond each row's first, at one bucket."""

    xy: float = 0.0  # extra positions x extra seconds, averaged
    xx: float = 0.0  # extra positions squared, averaged
    samples: int = 0

    def add(self, extra_positions: int, extra_seconds: float) -> None:
        self.xy = EMA * self.xy + (1 - EMA) * extra_positions * extra_seconds
        self.xx = EMA * self.xx + (1 - EMA) * extra_positions**2
        self.samples += 1

    def per_position(self) -> float | None:
        return max(0.0, self.xy / self.xx) if self.samples and self.xx > 0 else None


def slope_near(costs: dict[int, WidthCost], size: int) -> float | None:
    """The cost of a position at this bucket, or, until it has its own, at the nearest
    bucket that has one, so that a new batch size does not begin with a verification as
    wide as its drafts (with no slope, positions count as free). On a CPU it is within about
    2x across batch sizes (7.7 ms at batch 1, 3.5 ms at 16 for SmolLM2 here)."""
    known = {s: c.per_position() for s, c in costs.items()}
    known = {s: v for s, v in known.items() if v is not None}
    if not known:
        return None
    nearest = min(known, key=lambda s: (abs(s.bit_length() - size.bit_length()), s))
    return known[nearest]


@dataclass
class HitRate:
    """How often the drafter finds a draft when asked, decayed step by step. Asking costs
    even when nothing is found: the pending tokens are read back, which waits for the
    forward mlx-lm started ahead and drains its pipeline for a step."""

    hits: float = 0.0
    tries: float = 0.0

    def add(self, hit: bool) -> None:
        self.hits += hit
        self.tries += 1

    def decay(self) -> None:
        self.hits *= ACCEPTANCE_DECAY
        self.tries *= ACCEPTANCE_DECAY

    def rate(self, prior_rate: float = ACCEPTANCE_PRIOR[0], prior: float = ACCEPTANCE_PRIOR[1]) -> float:
        return (self.hits + prior * prior_rate) / (self.tries + prior)


@dataclass
class Acceptance:
    """Accepted positions and rejections (drafts not accepted whole), decayed step by step."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: int, drafted: int) -> None:
        self.accepted += accepted
        self.rejected += accepted < drafted

    def decay(self) -> None:
        self.accepted *= ACCEPTANCE_DECAY
        self.rejected *= ACCEPTANCE_DECAY

    def rate(self, prior_rate: float = ACCEPTANCE_PRIOR[0], prior: float = ACCEPTANCE_PRIOR[1]) -> float:
        """The chance a drafted token is accepted given the one before it was."""
        return (self.accepted + prior * prior_rate) / (self.accepted + self.rejected + prior)


@dataclass
class Calibration:
    """Tokens verifications emitted beyond one per row against what the acceptance model
    expected of them, both averaged. A row's rate comes from a short history, and a step is
    verified only when the estimates say it pays, so their errors lean one way: toward
    verifying. Expectations are scaled by this ratio."""

    expected: float = CALIBRATION_PRIOR
    emitted: float = CALIBRATION_PRIOR

    def add(self, expected: float, emitted: float) -> None:
        self.expected = EMA * self.expected + (1 - EMA) * max(0.0, expected)
        self.emitted = EMA * self.emitted + (1 - EMA) * max(0.0, emitted)

    def ratio(self) -> float:
        return self.emitted / self.expected if self.expected > 0 else 1.0


def expected_tokens(
    drafts: list[int], rates: list[float], width: int, uniform: bool, found: list[float] | None = None
) -> float:
    """Tokens a verification of this width is expected to emit: every row its first position
    plus, per drafted position j within the width, the chance the draft holds up to j (times
    the chance the drafter finds one at all, for drafts not yet made). Where every row keeps
    the same count (replayed families), a position counts for every row only if all rows
    accept it."""
    found = found or [1.0] * len(drafts)
    if uniform:
        everyone = 1.0
        for f in found:
            everyone *= f
        kept = sum(_all_accept(drafts, rates, j) for j in range(1, width))
        return len(drafts) * (1 + everyone * kept)
    return sum(1 + f * sum(q**j for j in range(1, min(d, width - 1) + 1)) for d, q, f in zip(drafts, rates, found))


def _all_accept(drafts: list[int], rates: list[float], j: int) -> float:
    chance = 1.0
    for d, q in zip(drafts, rates):
        chance *= q**j if d >= j else 0.0
    return chance


def choose_width(
    drafts: list[int],
    rates: list[float],
    step_seconds: float | None,
    per_position: float | None,
    uniform: bool,
    calibration: float = 1.0,
    found: list[float] | None = None,
) -> int:
    """The verification width (1 = a plain step) with the most expected tokens per second,
    the tokens beyond one per row scaled by what verifications have delivered against such
    expectations. Until a plain step's cost and a position's are known, width 2: the
    cheapest verification measures the slope without betting a wide pass on it."""
    longest = max(drafts, default=0)
    if longest == 0:
        return 1
    if step_seconds is None or per_position is None:
        return 2
    rows = len(drafts)
    best, best_rate = 1, WIDTH_MARGIN * rows / step_seconds
    for width in range(2, longest + 2):
        tokens = rows + calibration * (expected_tokens(drafts, rates, width, uniform, found) - rows)
        rate = tokens / (step_seconds + per_position * rows * (width - 1))
        if rate > best_rate:
            best, best_rate = width, rate
    return best
