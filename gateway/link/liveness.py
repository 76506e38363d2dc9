"""Liveness that tells a stalled machine from a dead worker.

Silence alone is weak evidence: when the whole host stalls (memory pressure, a laptop lid,
SIGSTOP of the gateway) every heartbeat is late, and killing workers then ends requests
that would have finished. So:
- a gateway that missed its own ticks blames nobody (its clock jumped, not the workers');
- a local worker is judged by its own process: stopped (SIGSTOP, a debugger) or gone is
  dead; running but silent is dead only once its engine watchdog said it made no progress
  for the hang bound, or after a hard bound;
- a busy worker is hung when it makes no progress, not when a step is long: the worker's
  heartbeats carry the seconds since its last progress (a finished step, or a layer group
  of a prefill step: worker/process/step_progress.py), so a slow host is never a hang;
- what killed a worker is kept apart (`LossKind`): its process exiting is a crash, and only
  a crash can make a request poison (gateway/link/quarantine.py); a kill for no progress or for
  silence is the watchdog's, counted apart and never blamed on the requests in flight;
- when every worker goes silent at once, that is logged as a host stall and they get
  time, up to the same hard bound; a remote worker (no process to look at) is otherwise
  dead after `liveness` missed heartbeats;
- heartbeats prove that a worker's link thread runs, not that its requests get anywhere: a
  worker with requests in flight whose progress count (heartbeats carry it; it moves with
  every event frame and every progress mark of a long step) stands still for the hang
  bound is hung, however regularly it heartbeats (gateway/link/worker_registry.py). Workers
  that do not report the count are judged as before;
- the other side of the link follows the same rule: a worker never gives up a stalled
  gateway before this hard bound, and keeps every frame for it meanwhile
  (worker/process/link.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import psutil


class LossKind(str, Enum):
    EXITED = "exited"  # the process ended by itself: a crash (its exit code says which kind)
    NO_PROGRESS = "no_progress"  # the watchdog: busy past the hang bound without progress
    SILENT = "silent"  # the watchdog: no heartbeats (stopped, or a remote worker unreachable)
    OTHER = "other"  # planned, or a protocol-level goodbye


def loss_kind(process: ProcessState, step_busy_s: float, limits: Limits) -> LossKind:
    """Which of the verdict's reasons applied (verdict's own order)."""
    if process is ProcessState.GONE:
        return LossKind.EXITED
    if step_busy_s > limits.hang_timeout_s:
        return LossKind.NO_PROGRESS
    return LossKind.SILENT


class ProcessState(str, Enum):
    GONE = "gone"
    STOPPED = "stopped"
    RUNNING = "running"  # runnable, sleeping or in I/O: it can still answer
    UNKNOWN = "unknown"  # not a process of ours (remote worker)


def probe(pid: int | None) -> ProcessState:
    if pid is None:
        return ProcessState.UNKNOWN
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ProcessState.GONE
    except psutil.Error:
        return ProcessState.UNKNOWN
    if status == psutil.STATUS_ZOMBIE or status == psutil.STATUS_DEAD:
        return ProcessState.GONE
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return ProcessState.STOPPED
    return ProcessState.RUNNING


@dataclass(frozen=True)
class Limits:
    window_s: float  # heartbeat_s * liveness
    hang_timeout_s: float  # busy this long without progress is a hang (the worker's watchdog)

    @property
    def hard_silence_s(self) -> float:
        """Silence that is death whatever the excuse."""
        return max(4 * self.window_s, 30.0)

    @property
    def loop_lag_s(self) -> float:
        """A heartbeat tick this late means the gateway itself was not running."""
        return max(self.window_s / 2, 1.0)


def verdict(silent_s: float, step_busy_s: float, process: ProcessState, limits: Limits, host_stall: bool) -> str | None:
    """Why the worker is dead or hung, or None while it may still be alive."""
    if process is ProcessState.GONE:
        return "its process has exited"
    if step_busy_s > limits.hang_timeout_s:
        return f"made no progress for {step_busy_s:.0f} s (hang watchdog)"
    if silent_s <= limits.window_s:
        return None
    if process is ProcessState.STOPPED:
        return f"silent for {silent_s:.1f} s and its process is stopped"
    if silent_s > limits.hard_silence_s:
        return f"silent for {silent_s:.1f} s"
    if process is ProcessState.RUNNING:
        if step_busy_s + silent_s > limits.hang_timeout_s:
            return (
                f"silent for {silent_s:.1f} s after its engine watchdog reported {step_busy_s:.0f} s without progress"
            )
        return None  # alive as a process: slow, not dead
    if host_stall:
        return None
    return f"silent for {silent_s:.1f} s"
