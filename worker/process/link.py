"""The worker's end of the ZeroMQ link, run in its own thread.

The engine thread may spend seconds inside one MLX call (a model load, a prefill chunk);
heartbeats must keep flowing meanwhile, so this thread owns the DEALER socket and talks
to the engine over an inproc PAIR (one socket per thread, as ZeroMQ wants). Hangs are
still visible: every heartbeat carries how long the engine has been inside its current
step without progress (a step's own progress marks, such as a prefill's layer groups, reset
that clock: worker/process/step_progress.py), and the gateway declares a worker hung past its limit.
A frozen process (SIGSTOP, deadlock holding the GIL) stops heartbeating altogether and is
declared dead.

A silent gateway is most often a stalled one (SIGSTOP, a long GIL hold, a loaded host), not
a dead one, so silence never costs a frame: the DEALER is kept, with a routing id of its own
that survives ZeroMQ's transport reconnects, and every frame waits in it until the gateway
reads again (a full socket blocks the engine: backpressure, not loss). Only past the hard
silence bound, when the gateway has given this worker up too, is the socket replaced
(Paranoid Pirate's reconnect); EVENTS frames carry a sequence number and the new HELLO
says which comes next, so the gateway ends the requests whose frames the old socket took
with an explicit error instead of a stream with a hole. A locally spawned worker exits
after `orphan_after` seconds of silence while its gateway runs (a stopped gateway is
waited for), so no worker outlives its gateway."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable

import msgpack
import zmq

from ...shared import protocol as p

log = logging.getLogger(__name__)


def _event_wire(event: object) -> dict:
    """msgpack's hook for what it cannot pack itself: an event dataclass as its wire map."""
    to_wire = getattr(event, "to_wire", None)
    if to_wire is None:
        raise TypeError(f"cannot encode {type(event).__name__} in an EVENTS frame")
    return to_wire()


def encode_events(**fields) -> bytes:
    """An EVENTS frame: its items are (request id, event dataclass) pairs, made typed by the
    schedulers and turned into wire maps here, once, as msgpack packs them (p.encode's frame,
    byte for byte what packing the wire maps themselves gives)."""
    frame = {"v": p.PROTOCOL_VERSION, "t": p.EVENTS, **fields}
    return msgpack.packb(frame, use_bin_type=True, default=_event_wire)


class WorkerLink:
    def __init__(
        self,
        endpoint: str,
        hello: dict,
        *,
        heartbeat_s: float = 1.0,
        liveness: int = 5,
        orphan_after: float | None = 15.0,
    ):
        self.endpoint = endpoint
        self.hello = hello
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.orphan_after = orphan_after
        self.ctx = zmq.Context.instance()
        addr = f"inproc://worker-link-{uuid.uuid4().hex}"
        self._engine_side = self.ctx.socket(zmq.PAIR)
        self._engine_side.bind(addr)
        self._io_side = self.ctx.socket(zmq.PAIR)
        self._io_side.connect(addr)
        self._stop = threading.Event()
        self.gateway_gone = threading.Event()
        self.stats: dict = {}
        self.state = "loading"
        self._step_started: float | None = None  # set by the engine around each step
        self.progress_at: float = 0.0  # the last progress mark inside the current step
        # Other phases the watchdog covers (request preparation): each returns seconds busy.
        self.busy_probes: list[Callable[[], float]] = []
        # While loading: how far the load has got (LoadProgress.snapshot), sent in heartbeats.
        self.load_probe: Callable[[], dict] | None = None
        # Gateway messages, decoded once by the I/O thread; a byte on the PAIR wakes the engine.
        self._inbox: queue.SimpleQueue[dict] = queue.SimpleQueue()
        # Events the engine sent since it last polled: they leave as one EVENTS frame (the
        # acceptances of every request taken in, and the step's output for all of them).
        self._events: list = []
        # EVENTS frames are numbered (the gateway detects lost ones); the sequence number of
        # each frame handed to the inproc pipe (None: not an EVENTS frame), in pipe order, so
        # the I/O thread knows which frame it last gave to the gateway socket.
        self._next_seq = 0
        self._pipe_seqs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._socket_seq = 0  # the sequence number the next EVENTS frame on the socket has
        # Progress the gateway can see in heartbeats: engine phases finished (a step, a
        # message handled), event frames sent and progress marks inside long steps. A worker
        # whose count stands still with requests in flight makes no progress on them
        # (gateway/link/liveness.py), however often it heartbeats.
        self.progress = 0
        # WELCOMEs heard (the I/O thread counts them): after each the engine tells the gateway
        # all its prefix cache holds (PREFIXES snapshot), so a restarted gateway has its index.
        self.welcomes = 0
        self._parent = os.getppid()
        self._thread = threading.Thread(target=self._run, name="worker-link", daemon=True)

    # -- engine side (engine thread only) ------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def send(self, msg_type: str, **fields) -> None:
        """Events (EVENTS with items) are gathered until the engine polls again, or flushes;
        every other message goes at once, after the events gathered before it."""
        if msg_type == p.EVENTS and fields.keys() == {"items"}:
            self._events.extend(fields["items"])
            return
        self.flush()
        if msg_type == p.EVENTS:
            self._send_events(fields)
            return
        self._pipe_seqs.put(None)
        self._engine_side.send(p.encode(msg_type, **fields))

    @property
    def step_started(self) -> float | None:
        """When the engine's current phase began (None between phases)."""
        return self._step_started

    @step_started.setter
    def step_started(self, value: float | None) -> None:
        if value is None and self._step_started is not None:
            self.progress += 1  # a phase finished: a step without events (a long audio batch) counts too
        self._step_started = value

    def mark_progress(self) -> None:
        """The engine got further inside its current step (any thread may call it)."""
        self.progress_at = time.monotonic()
        self.progress += 1

    def flush(self) -> None:
        """Send the gathered events now, as one frame."""
        if self._events:
            items, self._events = self._events, []
            self._send_events({"items": items})

    def _send_events(self, fields: dict) -> None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self.progress += 1
        self._pipe_seqs.put(seq)
        self._engine_side.send(encode_events(seq=seq, **fields))

    def poll(self, timeout_ms: int) -> list[dict]:
        """Messages from the gateway (decoded by the I/O thread); waits up to timeout_ms for the first one.
        The events gathered since the last poll are sent first."""
        self.flush()
        if self._inbox.empty() and not self._engine_side.poll(timeout_ms):
            return []
        while True:  # the wake-up bytes; the messages themselves are in the inbox
            try:
                self._engine_side.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._thread.join(timeout=2)

    # -- I/O thread ---------------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        # Its own routing id (never starting with a zero byte, which ZeroMQ reserves): when the
        # transport reconnects (a remote gateway's TCP connection dropped and came back), the
        # gateway still knows whose frames these are, and the frames queued meanwhile count.
        sock.setsockopt(zmq.ROUTING_ID, b"w" + uuid.uuid4().bytes)
        # Bounded buffers: a gateway that stops reading must not grow this process forever.
        sock.setsockopt(zmq.SNDHWM, int(os.environ.get("MLXGW_LINK_SNDHWM", "10000")))
        sock.connect(self.endpoint)
        sock.send(self._hello())
        return sock

    def _hello(self) -> bytes:
        # seq: the number of the next EVENTS frame this socket will carry; frames numbered
        # below it that the gateway has not seen were lost with a replaced socket.
        return p.encode(p.HELLO, **self.hello, state=self.state, seq=self._socket_seq)

    def _gateway_stopped(self) -> bool:
        """Whether the gateway that spawned this worker is stopped (SIGSTOP, a debugger):
        its silence is then a pause, not an absence."""
        try:
            with open(f"/proc/{self._parent}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False  # not Linux, or gone (the parent check sees that)
        return state in (b"T", b"t")

    def _heartbeat(self) -> bytes:
        started = self.step_started
        # Seconds without progress: since the step began, or since its last progress mark.
        stuck = time.monotonic() - max(started, self.progress_at) if started else 0.0
        busy = max([stuck] + [probe() for probe in self.busy_probes])
        stats = self.stats
        probe = self.load_probe
        if self.state == "loading" and probe is not None:
            try:
                stats = {**stats, "load": probe()}
            except Exception:  # a failed probe must never stop the heartbeats
                log.debug("load progress probe failed", exc_info=True)
        return p.encode(p.HEARTBEAT, state=self.state, stats=stats, step_busy_s=busy, progress=self.progress)

    def _run(self) -> None:
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._io_side, zmq.POLLIN)
        # Silence while the gateway could have answered: a stopped gateway's pause is not
        # counted (it is waited for), and hearing anything resets it.
        silent_for = 0.0
        warned = False
        now = next_beat = time.monotonic()
        pending: bytes | None = None  # a frame from the engine the gateway socket could not take yet
        while not self._stop.is_set():
            # While a frame waits for room, retry soon and leave the engine's frames queued:
            # the engine then blocks on the full inproc pipe, which is the backpressure we want
            # (a frame is never dropped, and memory stays bounded).
            if pending is None:
                poller.modify(self._io_side, zmq.POLLIN)
            else:
                poller.modify(self._io_side, 0)
            events = dict(poller.poll(10 if pending is not None else int(self.heartbeat_s * 250)))
            before, now = now, time.monotonic()
            heard = False
            if sock in events:
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    heard = True
                    self._on_gateway_frame(sock, frame)
            pending = self._forward(sock, pending)
            if now >= next_beat:
                try:
                    sock.send(self._heartbeat(), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the gateway is not reading; the frames ahead of it prove we are alive
                next_beat = now + self.heartbeat_s
            if os.getppid() != self._parent and self.orphan_after is not None:
                log.warning("parent process gone; worker exits")
                self.gateway_gone.set()
                return
            if heard:
                silent_for, warned = 0.0, False
                continue
            waited = now - before
            if waited > max(2 * self.heartbeat_s, 1.0):
                waited = 0.0  # this process did not run (a host asleep, SIGSTOP): not the gateway's silence
            elif silent_for + waited > self.heartbeat_s and self.orphan_after is not None and self._gateway_stopped():
                waited = 0.0  # a stopped gateway is paused, not absent: wait for it
            silent_for += waited
            if silent_for <= self.heartbeat_s * self.liveness:
                continue
            if not warned:
                log.warning("gateway silent for %.0f s; keeping the link and every frame for it", silent_for)
                warned = True
            if self.orphan_after is not None and silent_for > self.orphan_after:
                log.warning("gateway silent for %.0f s while running; worker exits", silent_for)
                self.gateway_gone.set()
                return
            if silent_for > self.hard_silence_s:
                # The gateway has given this worker up too (liveness.Limits.hard_silence_s):
                # a fresh socket, announced with the sequence number its frames start at.
                log.warning("gateway silent for %.0f s; reconnecting to %s", silent_for, self.endpoint)
                poller.unregister(sock)
                sock.close(linger=0)
                sock = self._connect()
                poller.register(sock, zmq.POLLIN)
                silent_for, warned = 0.0, False
        sock.close(linger=200)

    @property
    def hard_silence_s(self) -> float:
        """The gateway's own bound on silence (gateway/link/liveness.py Limits.hard_silence_s)."""
        return max(4 * self.heartbeat_s * self.liveness, 30.0)

    def _forward(self, sock: zmq.Socket, pending: bytes | None) -> bytes | None:
        """Move engine frames to the gateway until there are none or the socket is full;
        return the frame still waiting, if any."""
        while True:
            if pending is None:
                try:
                    pending = self._io_side.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return None
            try:
                sock.send(pending, zmq.NOBLOCK)
            except zmq.Again:
                return pending
            pending = None
            seq = self._pipe_seqs.get_nowait()  # put before its frame, so it is there
            if seq is not None:
                self._socket_seq = seq + 1

    def _on_gateway_frame(self, sock: zmq.Socket, frame: bytes) -> None:
        try:
            msg = p.decode(frame, p.GATEWAY_TYPES)
        except p.ProtocolError as e:
            log.warning("dropped message from gateway: %s", e)
            return
        if msg["t"] == p.WELCOME:
            self.welcomes += 1
            return
        if msg["t"] == p.HEARTBEAT:
            return
        if msg["t"] == p.RECONNECT:
            sock.send(self._hello())
            return
        self._inbox.put(msg)
        self._io_side.send(b"")
