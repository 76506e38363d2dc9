"""The link's records of its workers: one connection per worker, the local processes the
manager spawned (their pids, the ones that have left), liveness judgement, and ending every
request of a worker that is gone or whose frames were lost. The Broker (gateway/link/broker.py)
owns the sockets and one of these; which worker a request goes to is the Pool's
(gateway/link/pool.py), over the same connections.

Streams end exactly once and never with a hole: a worker lost with requests in flight ends
each with an explicit error; a worker that comes back under a new identity keeps its
requests only when its HELLO proves that no EVENTS frame went missing (the sequence number
it announces is the one the gateway expects next), else they end with an error too."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Error
from . import liveness as live
from .quarantine import Quarantine
from .worker_conn import ConnState, WorkerConn, WorkerEvent, WorkerIdle, WorkerLost

log = logging.getLogger(__name__)

# How long the frames a drained worker sent before exiting are waited for (they are already
# on this host; only a busy event loop delays reading them).
EXITED_READ_S = 2.0


class WorkerRegistry:
    """What the link knows about each worker, and when a worker is gone."""

    def __init__(self, limits: live.Limits, fail_calls: Callable[[WorkerConn, ServiceError], None]) -> None:
        self.limits = limits
        self.fail_calls = fail_calls  # answers the calls waiting on a lost worker (the Broker owns them)
        self.conns: dict[bytes, WorkerConn] = {}
        self.events: asyncio.Queue[WorkerEvent] = asyncio.Queue()
        self.quarantine = Quarantine()
        self.host_stalls = 0
        self._local: dict[str, int] = {}  # worker_id -> pid, for processes the manager spawned
        self._labels: dict[str, str] = {}  # worker_id -> its replica's label, for the same
        self._exited_fps: dict[str, list[str]] = {}  # worker_id -> in flight when seen gone
        # Workers that said goodbye (or whose process has exited): a later hello from one of
        # them is a worker on its way out answering our "who are you?", not a new worker.
        self._departed: OrderedDict[str, None] = OrderedDict()
        self._stalled = False
        self.lingering: set[asyncio.Task] = set()  # exited workers whose last frames are being read
        # Local workers asked to stop: one that says HELLO only now (a reload came while it
        # started) is draining from its first frame, and never routed to.
        self._draining: set[str] = set()

    # -- what the manager uses ---------------------------------------------------------------
    def expect_local(self, worker_id: str, pid: int, label: str = "") -> None:
        """A process the manager spawned: its liveness may be judged by its process state.
        label: its name in its model's pool ("<model>#<replica>")."""
        self._local[worker_id] = pid
        self._labels[worker_id] = label
        for conn in self.conns.values():
            if conn.worker_id == worker_id and not conn.remote:
                conn.local_pid = pid
                conn.replica.label = label

    def local_process(self, worker_id: str) -> tuple[int | None, str]:
        """The pid and pool label of a local worker this gateway spawned (None, "": not one)."""
        return self._local.get(worker_id), self._labels.get(worker_id, "")

    def departed(self, worker_id: str) -> bool:
        return worker_id in self._departed

    def drain_local(self, worker_id: str) -> None:
        """Route nothing new to the worker (it was asked to stop)."""
        self._draining.add(worker_id)
        for conn in self.conns.values():
            if conn.worker_id == worker_id and conn.state is not ConnState.LOST:
                conn.state = ConnState.DRAINING

    def release_local(self, worker_id: str, reason: str, planned: bool) -> list[str]:
        """The process has exited: forget its connection. The fingerprints of the requests it
        still had in flight are returned (the manager decides whether that was a crash)."""
        self._local.pop(worker_id, None)
        self._labels.pop(worker_id, None)
        self._draining.discard(worker_id)
        self.depart(worker_id)
        fps: list[str] = self._exited_fps.pop(worker_id, [])  # seen gone by the liveness check first
        for conn in [c for c in self.conns.values() if c.worker_id == worker_id and not c.remote]:
            if planned and conn.streams:
                # A drained worker answered everything before it exited, but on a busy host
                # its last frames (the finishes, then BYE) may still wait unread in the
                # socket when its exit is seen: read them before ending what is left.
                conn.state = ConnState.DRAINING
                task = asyncio.get_running_loop().create_task(self._drop_once_read(conn, reason))
                self.lingering.add(task)
                task.add_done_callback(self.lingering.discard)
                continue
            fps += self.drop(conn, reason, notify=False, planned=planned)
        return fps

    async def _drop_once_read(self, conn: WorkerConn, reason: str) -> None:
        deadline = time.monotonic() + EXITED_READ_S
        while conn.streams and self.conns.get(conn.identity) is conn and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.drop(conn, reason, notify=False, planned=True)

    def depart(self, worker_id: str) -> None:
        self._departed[worker_id] = None
        while len(self._departed) > 4096:
            self._departed.popitem(last=False)

    # -- a worker (re)announcing itself ----------------------------------------------------------
    def register(self, conn: WorkerConn, hello_seq: object) -> list[str]:
        """Record a worker that said HELLO. The same worker under a new identity (it replaced
        its socket) keeps its requests in flight only if no frame was lost on the way: its
        HELLO names the sequence number of its next EVENTS frame, which must be the one this
        gateway expects. Returns the routing ids of requests that had to end (to cancel)."""
        seq = hello_seq if isinstance(hello_seq, int) and not isinstance(hello_seq, bool) else None
        conn.next_seq = seq
        lost: list[str] = []
        for old in [c for c in self.conns.values() if c.worker_id == conn.worker_id and c.remote == conn.remote]:
            del self.conns[old.identity]
            intact = seq is not None and seq == (old.next_seq or 0)
            if not intact and old.streams:
                why = "it reconnected after losing events of these requests"
                lost += self._end_streams(old, why)
            lost += [rid for rid, stream in old.streams.items() if stream.cancelled]  # to cancel again
            conn.streams.update(old.streams)
            for stream in conn.streams.values():
                stream.conn = conn
            if old.state is ConnState.DRAINING:
                conn.state = ConnState.DRAINING
        if conn.worker_id in self._draining and not conn.remote:
            conn.state = ConnState.DRAINING
        self.conns[conn.identity] = conn
        return lost

    def check_seq(self, conn: WorkerConn, seq: object) -> list[str]:
        """An EVENTS frame's sequence number: a jump means frames were lost in transit, and
        every request in flight on the worker may have a hole: they end with an error.
        Returns their routing ids (to cancel in the worker)."""
        if not isinstance(seq, int) or isinstance(seq, bool):
            return []  # a worker that does not number its frames
        expected, conn.next_seq = conn.next_seq, seq + 1
        if expected is None or seq == expected:
            return []
        return self._end_streams(conn, f"{abs(seq - expected)} of its event frames were lost in transit")

    def _end_streams(self, conn: WorkerConn, why: str) -> list[str]:
        message = f"the worker serving {conn.model} lost part of this answer ({why}); retry the request"
        err = ServiceError(ErrorCode.WORKER_LOST, message)
        rids = list(conn.streams)
        if rids:
            log.warning("worker %s for %s: %s; ending %d requests", conn.worker_id, conn.model, why, len(rids))
        for stream in conn.streams.values():
            stream.push(Error(err))
        conn.streams.clear()
        if rids:
            self.events.put_nowait(WorkerIdle(conn))
        return rids

    # -- liveness ------------------------------------------------------------------------------
    def forgive_stall(self, now: float) -> None:
        """The gateway itself did not run: every worker gets a fresh window, for silence and
        for progress alike (their frames wait, unread, in the sockets)."""
        for conn in self.conns.values():
            conn.last_heard = max(conn.last_heard, now)
            conn.progress_at = max(conn.progress_at, now)

    def judge(self, now: float) -> None:
        conns = list(self.conns.values())
        silent = [c for c in conns if now - c.last_heard > self.limits.window_s]
        all_silent = len(conns) >= 2 and len(silent) == len(conns)
        if all_silent and not self._stalled:
            self.host_stalls += 1
            log.warning("all %d workers are silent at once: a host stall, not %d crashes", len(conns), len(conns))
        self._stalled = all_silent
        for conn in conns:
            silent_s = now - conn.last_heard
            process = self._process_state(conn, silent_s)
            why = live.verdict(silent_s, conn.step_busy_s, process, self.limits, all_silent)
            if why is not None:
                self.drop(conn, f"worker {why}", kind=live.loss_kind(process, conn.step_busy_s, self.limits))
                continue
            # Heartbeats prove the link thread runs, not that the requests get anywhere.
            stuck_s = now - conn.progress_at if conn.progress is not None and conn.streams else 0.0
            if stuck_s > self.limits.hang_timeout_s:
                why = f"made no progress on {conn.load} requests in flight for {stuck_s:.0f} s while heartbeating"
                self.drop(conn, f"worker {why}", kind=live.LossKind.NO_PROGRESS)

    def _process_state(self, conn: WorkerConn, silent_s: float) -> live.ProcessState:
        if conn.local_pid is None:
            return live.ProcessState.UNKNOWN
        if silent_s <= self.limits.window_s:
            return live.ProcessState.RUNNING  # heard from recently: no need to look
        return live.probe(conn.local_pid)

    def drop(
        self,
        conn: WorkerConn,
        reason: str,
        notify: bool = True,
        planned: bool = False,
        kind: live.LossKind = live.LossKind.OTHER,
        graceful: bool | None = None,
    ) -> list[str]:
        """Forget a worker: every request in flight on it ends with a worker_lost error.
        Returns the fingerprints of those requests. kind: why, for the fault counters.
        A graceful departure (planned: reload, unload; or a worker's BYE, which it sends
        only after answering every request it read) ends the requests it never took in (no
        event came for them: the frame reached a worker that had stopped reading) with a
        retryable model_unavailable instead: nothing ran, so the request waits for the
        model's next worker like any other (gateway/models/generation.py retries it). So do
        the requests a crashed worker never took in while another worker of its model is
        ready: they go to that one."""
        graceful = planned if graceful is None else graceful
        if self.conns.get(conn.identity) is not conn:
            return []
        del self.conns[conn.identity]
        graceful = graceful or any(
            c.model == conn.model and c.state is ConnState.READY and c.reachable for c in self.conns.values()
        )
        if planned:
            log.info("worker %s for %s left: %s", conn.worker_id, conn.model, reason)
        else:
            log.warning("lost worker %s for %s: %s", conn.worker_id, conn.model, reason)
        err = ServiceError(
            ErrorCode.WORKER_LOST, f"the worker serving {conn.model} stopped ({reason}); retry the request"
        )
        not_taken = ServiceError(
            ErrorCode.MODEL_UNAVAILABLE, f"the worker serving {conn.model} left before taking this request in",
            retry_after=1.0,
        )  # fmt: skip
        fps = [s.fingerprint for s in conn.streams.values()]
        if kind is live.LossKind.EXITED and conn.worker_id in self._local:
            # a crash of a local process: its exit code decides whether these were to blame
            self._exited_fps.setdefault(conn.worker_id, []).extend(fps)
        for stream in conn.streams.values():
            stream.push(Error(not_taken if graceful and not stream.heard else err))
        conn.streams.clear()
        self.fail_calls(conn, err)
        conn.state = ConnState.LOST
        if notify:
            self.events.put_nowait(WorkerLost(conn, reason, tuple(fps), kind))
        return fps
