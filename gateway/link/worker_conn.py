"""What the broker keeps per worker connection and per request, and the events it reports
to the model manager (through a queue: the broker holds no reference to the manager)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack
import zmq.asyncio

from ...shared.events import TERMINAL_EVENTS, AnyEvent, WireEnum
from .liveness import LossKind
from .quarantine import fingerprint


class ConnState(WireEnum):
    """A worker link's state, as /v1/status reports it."""

    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"


class RequestStream:
    """Events of one request, in order; ends with exactly one finish or error."""

    def __init__(
        self,
        rid: str,
        label: str,
        conn: WorkerConn,
        owner: str | None = None,
        fp: str | None = None,
        frame: bytes = b"",
    ):
        self.rid = rid  # the routing id: generated here, unique in this gateway's lifetime
        self.label = label  # the id the client knows (its x-request-id, or the gateway's)
        self.conn = conn
        self.owner = owner  # the API key's name, when keys are on: who may cancel it
        # The quarantine's fingerprint, computed when first asked for (a worker crashed with
        # this request in flight): from the frame as sent, which nothing can change since.
        self._fingerprint = fp
        self._frame = frame
        self.done = False
        self.heard = False  # the worker sent an event for it: it was taken in
        self.cancelled = False  # the gateway asked the worker to stop it (sent again after a reconnect)
        # One reader (the request's Generation): a deque and one waiter future cost less per
        # token than an asyncio.Queue.
        self._events: deque[AnyEvent] = deque()
        self._waiter: asyncio.Future | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            wire = msgpack.unpackb(self._frame, raw=False, strict_map_key=False)["request"]
            self._fingerprint = fingerprint(wire)
        return self._fingerprint

    def push(self, event: AnyEvent) -> None:
        if self.done:
            return
        self.heard = True
        if isinstance(event, TERMINAL_EVENTS):
            self.done = True
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def ready(self) -> bool:
        """An event is waiting: take() returns it."""
        return bool(self._events)

    def take(self) -> AnyEvent:
        """The next event, which ready() said is here."""
        return self._events.popleft()

    async def next(self, timeout: float | None = None) -> AnyEvent:
        # The hot path (a step's events already here) costs no task, future or timer.
        if self._events:
            return self._events.popleft()
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await waiter
        finally:
            self._waiter = None
        return self._events.popleft()


@dataclass
class ReplicaStats:
    """One worker's part in its model's pool (gateway/link/pool.py): how requests came to it,
    how its prefix cache served them, and its circuit breaker."""

    label: str = ""  # its stable name in the pool: "<model>#<n>" for local replicas, else its worker id
    by_prefix: int = 0  # routed here because it held the longest prefix of the request
    by_session: int = 0  # by the client's session id or the session's first turn (rendezvous hash)
    by_load: int = 0  # the least loaded (policy load, or the prefix's holder was too busy)
    prompt_tokens: int = 0  # of finished requests
    cached_tokens: int = 0  # of those, read from its prefix cache
    cold_warm_turns: int = 0  # later turns of a session that read less than half their prompt from its cache
    failures: int = 0  # requests that failed in a row (worker-side errors)
    open_until: float = 0.0  # circuit breaker: routed nothing new until then (unless it is the only one)
    opened: int = 0  # times the breaker opened
    # What it reported of its prefix cache (PREFIXES): chain entries stored, entries evicted
    # (memory and disk), and snapshots of all it holds (one after each connect).
    reported_held: int = 0
    reported_evicted: int = 0
    snapshots: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(eq=False)
class WorkerConn:
    identity: bytes
    worker_id: str
    model: str
    kind: str
    pid: int | None  # as the worker reports it (remote: another host's pid)
    state: ConnState = ConnState.LOADING
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    last_heard: float = field(default_factory=time.monotonic)
    step_busy_s: float = 0.0
    streams: dict[str, RequestStream] = field(default_factory=dict)
    local_pid: int | None = None  # set only for processes this gateway spawned
    remote: bool = False
    sock: zmq.asyncio.Socket | None = None
    reachable: bool = True  # False after a send found no peer (it may be reconnecting)
    # The sequence number the next EVENTS frame must carry (None: the worker does not number
    # them, or none came yet): a jump means frames were lost between worker and gateway.
    next_seq: int | None = None
    # The worker's progress count from its heartbeats (None: a worker that does not report
    # it), and when it last moved, an EVENTS frame came, or its first request went out.
    progress: int | None = None
    progress_at: float = field(default_factory=time.monotonic)
    replica: ReplicaStats = field(default_factory=ReplicaStats)
    connected_at: float = field(default_factory=time.monotonic)  # its HELLO: a snapshot is of later

    @property
    def load(self) -> int:
        return len(self.streams)


@dataclass(frozen=True)
class WorkerReady:
    conn: WorkerConn


@dataclass(frozen=True)
class WorkerLoadFailed:
    conn: WorkerConn
    message: str


@dataclass(frozen=True)
class WorkerLost:
    conn: WorkerConn
    reason: str
    fingerprints: tuple[str, ...]  # of the requests it had in flight
    kind: LossKind = LossKind.OTHER  # only an exit can be a request's fault


@dataclass(frozen=True)
class WorkerIdle:
    conn: WorkerConn  # its last request in flight has ended


@dataclass(frozen=True)
class WorkerBack:
    conn: WorkerConn  # answered again after a send found no peer: routable again


WorkerEvent = WorkerReady | WorkerLoadFailed | WorkerLost | WorkerIdle | WorkerBack
