"""How many threads the CPU BLAS uses for each kind of step, chosen by measuring both.

On MLX's CPU backend every matmul of the forward is an OpenBLAS call, and OpenBLAS splits
each call over its threads and joins them at the end. On a quiet host that is faster. On a
host whose cores are taken by other work, each call waits for its slowest thread to be
scheduled, hundreds of times per forward. Measured on the 2-core machine (SmolLM2-135M
float32, one decode forward; bench/HISTORY.md at 3b9d616, "busy host"):

| | quiet, 2 threads | quiet, 1 | 2 busy loops, 2 threads | 2 busy loops, 1 |
|---|---|---|---|---|
| batch 1 | 96 ms | 129 ms | 871 ms | 253 ms |
| batch 8 | 132 ms | 177 ms | 216 ms | 329 ms |

So the right count depends on the host's load and on the step's shape, and neither is known
in advance: a step's kind (its decode rows, to a power of two, and whether it reads a prompt)
keeps the last few start-to-start times of each count, takes the faster one, and tries the
other again now and then (every 16 steps of that kind at first, backing off to every 256
while the choice holds, back to 16 when it flips), so a host that gets busy or quiet is
followed within a few dozen steps.

A busy host is a property of the host, not of a kind of step: once a kind has measured one
count BUSY_RATIO times cheaper than the other, a kind that has not yet measured both follows
that verdict with no trial of its own (see BUSY_RATIO).

The count changes only between steps, with the step's stream synchronised first: OpenBLAS's
count is process-wide, and no call may be running when it changes.

What a count costs is the mean of its last few samples (a busy host's stalls are what it
pays; see CAP), and a sample is a step's time per position it fed (its decode rows plus the
prompt tokens it read); a speculative verification is no sample. Raw step times were
compared before: steps of one kind read prompt chunks of different lengths and verified
drafts of different widths, so three samples of each count were decided by which steps they
happened to be as much as by the count (traced through the server, MLXGW_STEP_TRACE and
bench/step/trace.py; bench/HISTORY.md at 3b9d616, "The BLAS policy's samples").

Where the count cannot be set (Metal or CUDA, where matmuls do not run on the CPU BLAS;
macOS's Accelerate) the policy is off: `shared/platform.py` says which.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

from ....shared.platform import BlasThreads, blas_threads, on_cpu_device

SAMPLES = 3  # start-to-start times kept per count and kind of step (their mean decides)
TRIAL_STEPS = 3  # consecutive steps a count is tried for, so its samples are fresh
FIRST_INTERVAL = 16  # steps of a kind between trials of the other count, at first
MAX_INTERVAL = 256
# A count's cost is the mean of its recent samples, not their median: on a busy host two
# threads' steps are bimodal (at 8 rows, 170-250 ms when both threads got a core, 3.5-4 s
# when one waited), and the median of three, with every 4 s step dropped as an "idle wait"
# at 10x the median, kept two threads at 300 ms a position where one thread took 34 (traced,
# bench/HISTORY.md at 3b9d616, "The BLAS policy on a busy host"). A long sample counts, capped at CAP x
# the median; only one past IDLE_GAP x the median is taken for a wait with nothing to do.
CAP = 10.0
IDLE_GAP = 100.0
# Another count replaces the one in use only when its mean is this much lower: where the two
# are within a few percent of each other (a quiet host at 1-4 rows) three samples
# flipped between them on noise, and each flip ran a kind of step at the other count for up to
# an interval (a quiet host's traces: 180 of 899 batch-1 steps at one thread, 7% slower there).
SWITCH_MARGIN = 0.05
OUTDATED = 1.25  # the count in use costing this x another's last measure brings a trial forward
# A kind's verdict this lopsided (the other count this x dearer) is the host's: every kind
# that has not measured both counts yet follows it instead of learning alone. Learning alone
# cost a busy host most of a burst: each kind of step (rows to a power of two, reading a
# prompt or not) started at two threads and kept them for three samples, and a burst of 32
# short requests met a dozen kinds, each new one's two-thread steps taking 3.5-17 s where one
# thread took 0.2-2 (traced, `--busy 2`, c = 32; bench/HISTORY.md at 3b9d616, "The BLAS policy's
# verdict is the host's"). On a quiet host the counts differ by 1.3-1.4x, under this ratio,
# so every kind still learns its own count there.
BUSY_RATIO = 2.0


def _median(values) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _mean(values) -> float:
    return sum(values) / len(values)


@dataclass
class KindChoice:
    """The thread counts' recent step times for one kind of step, and which one is used.

    The count in use is measured at every step of the kind; another count is tried for
    TRIAL_STEPS steps in a row once the one in use has its samples, and then every
    `interval` steps. The step right after a change is not a sample: it paid for the
    synchronisation and for waking the BLAS threads."""

    counts: tuple[int, ...]
    times: dict[int, deque] = field(default_factory=dict)
    current: int = 0
    trial: int | None = None  # the count being tried
    trial_left: int = 0
    since_trial: int = 0
    interval: int = FIRST_INTERVAL

    def __post_init__(self) -> None:
        self.times = {n: deque(maxlen=SAMPLES) for n in self.counts}
        self.current = max(self.counts)

    def _measured(self, count: int) -> bool:
        return len(self.times[count]) >= SAMPLES

    def choose(self, host: int | None = None) -> int:
        """The count for the next step of this kind. host: the count the host's last
        lopsided verdict chose (BUSY_RATIO); followed, with no trial, until this kind has
        measured every count itself."""
        if host is not None and not all(self._measured(n) for n in self.counts):
            self.current, self.trial = host, None
            return host
        if self.trial is None and self._measured(self.current):
            untried = [n for n in self.counts if n != self.current and not self._measured(n)]
            if untried or self.since_trial >= self.interval or self._outdated():
                others = untried or [n for n in self.counts if n != self.current]
                self.trial, self.trial_left, self.since_trial = others[0], TRIAL_STEPS, 0
        return self.current if self.trial is None else self.trial

    def _outdated(self) -> bool:
        """The count in use now costs OUTDATED x what another cost when last tried: the choice
        no longer rests on what was measured, so that count is tried again now, not an
        interval later (a host that got busy after a quiet start ran 74 steps at two threads
        and 800 ms each, where one thread took 150, waiting for its next trial)."""
        now = _mean(self.times[self.current])
        return any(
            n != self.current and self._measured(n) and now > OUTDATED * _mean(self.times[n]) for n in self.counts
        )

    def record(self, count: int, seconds: float, after_change: bool) -> tuple[int, float] | None:
        """A step's sample; when it ended a trial, the decision: (the count chosen, how many
        times dearer the other count was)."""
        if after_change:
            return None
        samples = self.times[count]
        if len(samples) >= SAMPLES:
            typical = _median(samples)
            if seconds > IDLE_GAP * typical:
                return None
            seconds = min(seconds, CAP * typical)
        samples.append(seconds)
        if self.trial != count:
            self.since_trial += 1
            return None
        self.trial_left -= 1
        if self.trial_left > 0:
            return None
        self.trial = None
        return self._decide()

    def _decide(self) -> tuple[int, float]:
        best = min((n for n in self.counts if self._measured(n)), key=lambda n: _mean(self.times[n]))
        if _mean(self.times[best]) > (1 - SWITCH_MARGIN) * _mean(self.times[self.current]):
            best = self.current  # not clearly faster: keep the count in use
        others = [_mean(self.times[n]) for n in self.counts if n != best and self._measured(n)]
        ratio = max(others, default=1.0) / max(_mean(self.times[best]), 1e-9)
        if best == self.current:
            # the dearer the other count, the rarer its trials: a trial of a count 4x slower
            # costs 12 steps' worth of time
            self.interval = min(MAX_INTERVAL, int(self.interval * 2 * max(1.0, ratio)))
        else:
            self.current, self.interval = best, FIRST_INTERVAL
        return best, ratio


class BlasThreadPolicy:
    """Per step: `start(kind)` before it, `done(positions)` after it, `idle()` when the batch
    runs dry after it."""

    def __init__(self, control: BlasThreads, synchronize):
        self.control = control
        self.synchronize = synchronize  # waits for the step's stream: nothing of BLAS runs
        self.most = control.get()
        self.counts = (1, self.most) if self.most > 1 else (self.most,)
        self.kinds: dict[tuple[int, bool], KindChoice] = {}
        self.threads = self.most
        self.host: int | None = None  # the count of the last lopsided verdict of any kind (BUSY_RATIO)
        self._open: list | None = None  # [choice, count, started, changed, positions] of the running step
        self.switches = 0

    @property
    def active(self) -> bool:
        return len(self.counts) > 1

    @staticmethod
    def kind(decode_rows: int, reads_prompt: bool) -> tuple[int, bool]:
        return (1 << max(0, decode_rows - 1).bit_length() if decode_rows else 0, reads_prompt)

    def start(self, decode_rows: int, reads_prompt: bool, pinned: bool = False) -> None:
        """Before a step with `decode_rows` rows generating, reading a prompt or not.
        pinned: a row needs the same rounding as it would get alone (a seeded draw), so the
        step runs at every thread, as a worker without this policy would, and is no sample:
        OpenBLAS's result differs in its last bits between counts, which moved a seeded
        row's sample at temperature 1 to the neighbouring token (tests/unit/test_batch_sampler.py)."""
        now = time.perf_counter()
        self._close(now)
        if not decode_rows and not reads_prompt:
            return  # nothing runs
        if pinned:
            self._use(self.most)
            return
        key = self.kind(decode_rows, reads_prompt)
        choice = self.kinds.get(key)
        if choice is None:
            choice = self.kinds[key] = KindChoice(self.counts)
        count = choice.choose(self.host)
        changed = self._use(count)
        self._open = [choice, count, time.perf_counter() if changed else now, changed, 1]

    def done(self, positions: int, sample: bool = True) -> None:
        """The step fed `positions` tokens through the model (decode rows plus prompt tokens
        read); sample=False: it is no sample of its kind (a speculative verification: its
        width, not the thread count, decides its time)."""
        if self._open is not None:
            if sample:
                self._open[4] = max(1, positions)
            else:
                self._open = None

    def _use(self, count: int) -> bool:
        """The count for the next step, set with the stream synchronised; whether it changed."""
        if count == self.threads:
            return False
        self.synchronize()
        self.control.set(count)
        self.threads, self.switches = count, self.switches + 1
        return True

    def idle(self) -> None:
        """The batch has nothing left: the step that just ran ends now, not at the next one."""
        self._close(time.perf_counter())

    def _close(self, now: float) -> None:
        if self._open is not None:
            choice, count, started, changed, positions = self._open
            self._open = None
            verdict = choice.record(count, (now - started) / positions, changed)
            if verdict is not None:  # the kind just decided: is the host lopsided?
                best, ratio = verdict
                self.host = best if ratio >= BUSY_RATIO else None

    def summary(self) -> dict:
        """What /v1/status shows: the count in use per kind of step."""
        return {
            "threads": self.threads,
            "switches": self.switches,
            "host": self.host,
            "by_kind": {f"{rows}{'+prompt' if prompt else ''}": c.current for (rows, prompt), c in self.kinds.items()},
        }


def policy_for(mx, generator) -> BlasThreadPolicy | None:
    """The policy for a worker whose model runs on the CPU with a settable BLAS; None
    elsewhere, or with MLXGW_ADAPTIVE_BLAS=0 (the BLAS's own count, as before)."""
    if os.environ.get("MLXGW_ADAPTIVE_BLAS", "1") == "0" or not on_cpu_device():
        return None
    control = blas_threads()
    if control is None:
        return None
    policy = BlasThreadPolicy(control, lambda: mx.synchronize(generator.stream))
    return policy if policy.active else None
