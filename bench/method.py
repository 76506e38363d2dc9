"""How every comparative bench runs its rounds, so that the method cannot move the result:

- at least 3 rounds by default (fewer is allowed for smoke runs, and said loudly);
- within each round every server (or variant) runs once, the order rotated each round, so
  drift in the machine (thermal, other load) lands on all of them alike;
- the load average is recorded at the start and end of every round and printed beside it;
- `--busy N` starts N fixed CPU busy loops for the whole run (the same for every server),
  so "busy" means the same thing each time; they stop at the end and bound themselves;
- a run whose rounds disagree by more than `--max-spread` ((max - min) / median) is
  flagged: in its table, by a loud line on stderr and by exit status UNSTABLE_EXIT.

Used by bench/run.py (`mlxgw bench`), bench/serving/peers.py and bench/speculation/matrix.py."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from .stats import Summary

T = TypeVar("T")

DEFAULT_ROUNDS = 3
DEFAULT_MAX_SPREAD = 0.10
UNSTABLE_EXIT = 3  # the run finished, but its rounds disagree: its figures are not a result
BUSY_MAX_S = 4 * 3600.0  # a busy loop ends itself after this, whatever happens to its parent

# A busy loop: pure-Python spinning on one core; it checks now and then that the bench that
# started it is still alive, and ends at its deadline in any case.
_BUSY_LOOP = """
import os, sys, time
deadline = time.monotonic() + float(sys.argv[1])
parent = os.getppid()
n = 0
while True:
    n += 1
    if n % 200_000 == 0 and (time.monotonic() > deadline or os.getppid() != parent):
        break
"""


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The order for round `round_index` (0-based): each round starts one item later."""
    items = list(items)
    if not items:
        return items
    k = round_index % len(items)
    return items[k:] + items[:k]


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@dataclass
class RoundLog:
    """What one round ran and under what load."""

    round: int  # 1-based
    order: list[str]
    load_start: float | None
    load_end: float | None = None
    seconds: float | None = None
    busy_loops: int = 0

    def line(self) -> str:
        busy = f", {self.busy_loops} busy loops" if self.busy_loops else ""
        return (
            f"round {self.round}: order {' -> '.join(self.order)}; load average "
            f"{self.load_start} -> {self.load_end}; {self.seconds} s{busy}"
        )


@dataclass
class Method:
    """The rounds of one run: their order, their load, and the spread test."""

    rounds: int = DEFAULT_ROUNDS
    max_spread: float | None = DEFAULT_MAX_SPREAD  # None: never flag
    busy: int = 0
    busy_max_s: float = BUSY_MAX_S
    logs: list[RoundLog] = field(default_factory=list)
    unstable: list[str] = field(default_factory=list)
    _busy_running: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError("rounds must be at least 1")
        if not 0 <= self.busy <= 4 * (os.cpu_count() or 1):
            raise ValueError(f"--busy takes a number of loops from 0 to 4 x the {os.cpu_count()} cores")

    def each_round(self, items: Sequence[T], label=str, log=print) -> Iterator[tuple[int, list[T]]]:
        """(round index, items in this round's order), recording each round's load."""
        if self.rounds < DEFAULT_ROUNDS:
            loud(f"only {self.rounds} round(s): fewer than {DEFAULT_ROUNDS}, so no figure of this run is verified")
        for rnd in range(self.rounds):
            order = rotated(items, rnd)
            entry = RoundLog(rnd + 1, [label(x) for x in order], load_average(), busy_loops=self.busy)
            started = time.monotonic()
            yield rnd, order
            entry.load_end = load_average()
            entry.seconds = round(time.monotonic() - started, 1)
            self.logs.append(entry)
            log(entry.line())

    def check(self, name: str, summary: Summary) -> bool:
        """Flag `name` when its rounds disagree by more than max_spread; True if flagged."""
        if summary.unstable(self.max_spread):
            rounds = ", ".join(f"{v:g}" for v in summary.rounds)
            self.unstable.append(f"{name}: rounds {rounds}, spread {summary.spread:.0%}")
            return True
        return False

    def flag_cell(self, summary: Summary) -> str:
        """The table's verdict on one figure's rounds."""
        if summary.spread is None:
            return "1 round" if len(summary.rounds) == 1 else ""
        mark = "UNSTABLE " if summary.unstable(self.max_spread) else ""
        return f"{mark}{summary.spread:.0%}"

    def finish(self) -> int:
        """A loud line per unstable figure; the exit status the run should end with."""
        if not self.unstable:
            return 0
        loud(
            f"{len(self.unstable)} figure(s) vary across rounds by more than --max-spread "
            f"{self.max_spread:.0%}: this run is not a result; rerun on a quieter machine"
        )
        for line in self.unstable:
            loud(f"  {line}")
        return UNSTABLE_EXIT

    def header(self) -> str:
        """The method in one line, for the top of a table."""
        spread = "off" if self.max_spread is None else f"{self.max_spread:.0%}"
        return (
            f"{self.rounds} round(s), order rotated each round, median (every round in brackets), "
            f"max spread {spread}, busy loops {self.busy}"
        )

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "max_spread": self.max_spread,
            "busy": self.busy,
            "round_logs": [asdict(x) for x in self.logs],
            "unstable": list(self.unstable),
        }

    @contextlib.contextmanager
    def busy_loops(self) -> Iterator[None]:
        """self.busy CPU busy loops for the duration of the block, stopped at its end (a block
        nested in another of the same run keeps the outer block's loops: never 2N)."""
        if self._busy_running:
            yield
            return
        self._busy_running = True
        try:
            with busy_loops(self.busy, self.busy_max_s):
                yield
        finally:
            self._busy_running = False


@contextlib.contextmanager
def busy_loops(n: int, max_s: float = BUSY_MAX_S) -> Iterator[list[subprocess.Popen]]:
    """n processes spinning one core each; terminated when the block ends (and each ends
    itself after max_s, or soon after this process dies)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(max_s)], stdin=subprocess.DEVNULL) for _ in range(n)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def loud(message: str) -> None:
    print(f"!!! {message}", file=sys.stderr, flush=True)


def spread_arg(text: str) -> float | None:
    """--max-spread: a fraction (0.1) or a percentage (10%); 'off' disables the flag."""
    text = text.strip().lower()
    if text in ("off", "none"):
        return None
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if value < 0:
        raise ValueError("--max-spread must be 0 or more")
    return value


def busy_arg(text: str) -> int:
    """--busy: a number of loops, checked as Method checks it."""
    value = int(text)
    Method(busy=value)
    return value


def add_arguments(ap: argparse.ArgumentParser, rounds: int = DEFAULT_ROUNDS) -> None:
    """The method's flags, the same in every bench that compares."""
    ap.add_argument("--rounds", type=int, default=rounds, help=f"rounds, order rotated each (default {rounds})")
    ap.add_argument(
        "--max-spread",
        type=spread_arg,
        default=DEFAULT_MAX_SPREAD,
        help="flag the run (exit status 3) when a figure's rounds differ by more than this share "
        "of its median: 0.1 or 10%% (default), 'off' never flags",
    )
    ap.add_argument("--busy", type=busy_arg, default=0, help="N fixed CPU busy loops beside every server")


def from_args(args: argparse.Namespace) -> Method:
    return Method(rounds=args.rounds, max_spread=args.max_spread, busy=args.busy)
