"""The gateway's end of the ZeroMQ link: a small Majordomo broker.

One ROUTER socket for local workers (ipc), and one for remote workers when the gateway
listens for them (tcp, with a maximum message size so that nobody can send gigabytes
before authenticating). Workers connect DEALERs and announce the model they serve. The
broker keeps a connection record per worker, heartbeats every one, judges liveness
(gateway/liveness.py), routes requests under ids it generates itself, and fans the batched
events back out to per-request streams. A worker lost with requests in flight ends each of
them with an explicit error event: streams end exactly once, never by hanging.

What the model manager needs to hear (a worker ready, failed to load, lost, idle) is put
on `events`, a queue the manager consumes: the broker holds no reference to the manager."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from collections import OrderedDict

import zmq
import zmq.asyncio

from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError

from . import liveness as live
from . import wire_checks as wc
from .quarantine import Quarantine, fingerprint
from .worker_conn import (
    ConnState,
    RequestStream,
    WorkerBack,
    WorkerConn,
    WorkerEvent,
    WorkerIdle,
    WorkerLoadFailed,
    WorkerLost,
    WorkerReady,
)

__all__ = [
    "Broker",
    "ConnState",
    "RequestStream",
    "WorkerBack",
    "WorkerConn",
    "WorkerEvent",
    "WorkerIdle",
    "WorkerLoadFailed",
    "WorkerLost",
    "WorkerReady",
]

log = logging.getLogger("mlxgw.broker")

# Largest message a remote worker may send (embedding batches are the big ones).
REMOTE_MAX_MESSAGE_BYTES = 64 << 20
LOG_EVERY_S = 10.0  # rejected frames: one log line per kind per interval, with a count
# Containers inside containers in one request (HTTP bodies already stop at 64: api/body.py).
MAX_WIRE_DEPTH = 256


class _RateLimitedLog:
    """At most one line per kind every LOG_EVERY_S, saying how many were suppressed."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._suppressed.pop(kind, 0)
        suffix = f" (and {skipped} more like it in the last {LOG_EVERY_S:g} s)" if skipped else ""
        log.warning(message + suffix, *args)


def _nested_deeper_than(value, limit: int) -> bool:
    """Iteratively, so that the check itself cannot hit the recursion limit."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth >= limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return False


def _encoding_error(e: Exception) -> ServiceError:
    if isinstance(e, UnicodeError):
        why = "it holds text that is not valid Unicode (an unpaired surrogate)"
    elif isinstance(e, OverflowError):
        why = "it holds an integer outside the 64-bit range"
    elif "recursion" in str(e) or isinstance(e, RecursionError):
        why = "it is nested too deeply"
    else:
        why = "it holds a value that cannot be sent to the model worker"
    return ServiceError(ErrorCode.INVALID_REQUEST, f"the request cannot be processed: {why}")


class Broker:
    def __init__(
        self,
        endpoint: str,
        *,
        heartbeat_s: float = 1.0,
        liveness: int = 5,
        hang_timeout_s: float = 120.0,
        secret: str = "",
        extra_endpoints: tuple[str, ...] = (),
        remote_max_message_bytes: int = REMOTE_MAX_MESSAGE_BYTES,
    ):
        self.endpoint = endpoint
        self.extra_endpoints = extra_endpoints  # e.g. tcp:// for remote workers
        self.heartbeat_s = heartbeat_s
        self.limits = live.Limits(heartbeat_s * liveness, hang_timeout_s)
        self.secret = secret
        self.remote_max_message_bytes = remote_max_message_bytes
        self.conns: dict[bytes, WorkerConn] = {}
        self.events: asyncio.Queue[WorkerEvent] = asyncio.Queue()
        self.quarantine = Quarantine()
        self.dropped_messages = 0
        self.host_stalls = 0
        self._local: dict[str, int] = {}  # worker_id -> pid, for processes the manager spawned
        self._exited_fps: dict[str, list[str]] = {}  # worker_id -> in flight when seen gone
        # Workers that said goodbye (or whose process has exited): a later hello from one of
        # them is a worker on its way out answering our "who are you?", not a new worker.
        self._departed: OrderedDict[str, None] = OrderedDict()
        self._replies: dict[int, asyncio.Future] = {}
        self._call_conns: dict[int, WorkerConn] = {}  # the worker each pending call went to
        self._cids = itertools.count(1)
        self._rids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._rejects = _RateLimitedLog()
        self._stalled = False
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.remote_sock = self.ctx.socket(zmq.ROUTER) if extra_endpoints else None
        self._refused_versions: set[bytes] = set()

    async def start(self) -> None:
        for sock in (self.sock, self.remote_sock):
            if sock is not None:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends raise, not vanish
        self.sock.bind(self.endpoint)
        loops = [self._recv_loop(self.sock, remote=False)]
        if self.remote_sock is not None:
            # Set before bind: applies to every peer, authenticated or not.
            self.remote_sock.setsockopt(zmq.MAXMSGSIZE, self.remote_max_message_bytes)
            for extra in self.extra_endpoints:
                self.remote_sock.bind(extra)
            loops.append(self._recv_loop(self.remote_sock, remote=True))
        self._tasks = [asyncio.create_task(c, name="broker-recv") for c in loops]
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="broker-heartbeat"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        left = sum(c.load for c in self.conns.values())
        if left:
            log.error("%d requests were still in flight at shutdown; ending them with an error", left)
        for conn in list(self.conns.values()):
            self.drop(conn, "gateway shutting down", notify=False, planned=True)
        for sock in (self.sock, self.remote_sock):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()

    # -- what the manager uses ---------------------------------------------------------------
    def workers(self, model: str) -> list[WorkerConn]:
        return [c for c in self.conns.values() if c.model == model]

    def ready_workers(self, model: str) -> list[WorkerConn]:
        return [c for c in self.workers(model) if c.state is ConnState.READY and c.reachable]

    def least_loaded(self, model: str) -> WorkerConn | None:
        ready = self.ready_workers(model)
        return min(ready, key=lambda c: c.load) if ready else None

    def in_flight(self, model: str) -> int:
        return sum(c.load for c in self.workers(model))

    def expect_local(self, worker_id: str, pid: int) -> None:
        """A process the manager spawned: its liveness may be judged by its process state."""
        self._local[worker_id] = pid
        for conn in self.conns.values():
            if conn.worker_id == worker_id and not conn.remote:
                conn.local_pid = pid

    def drain_local(self, worker_id: str) -> None:
        """Route nothing new to the worker (it was asked to stop)."""
        for conn in self.conns.values():
            if conn.worker_id == worker_id and conn.state is not ConnState.LOST:
                conn.state = ConnState.DRAINING

    def release_local(self, worker_id: str, reason: str, planned: bool) -> list[str]:
        """The process has exited: forget its connection. The fingerprints of the requests it
        still had in flight are returned (the manager decides whether that was a crash)."""
        self._local.pop(worker_id, None)
        self._depart(worker_id)
        fps: list[str] = self._exited_fps.pop(worker_id, [])  # seen gone by the liveness check first
        for conn in [c for c in self.conns.values() if c.worker_id == worker_id and not c.remote]:
            fps += self.drop(conn, reason, notify=False, planned=planned)
        return fps

    # -- routing ------------------------------------------------------------------------------
    async def submit(self, conn: WorkerConn, req: p.WorkerRequest, owner: str | None = None) -> RequestStream:
        """Send a request under a fresh routing id. Encoding and the quarantine check happen
        before the stream is registered: a refused request leaves nothing behind."""
        label = req.rid
        rid = f"{label}#{next(self._rids)}"
        try:
            wire = req.to_wire()
            wire["rid"] = rid
            if _nested_deeper_than(wire, MAX_WIRE_DEPTH):
                raise RecursionError("the request is nested too deeply")
            frame = p.encode(req.WIRE_TYPE, request=wire)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            raise _encoding_error(e) from None
        fp = None  # computed when a crash needs it (RequestStream.fingerprint), or now to check it
        if self.quarantine.watching(conn.model):
            fp = fingerprint(wire)
            self.quarantine.check(conn.model, fp)
        stream = RequestStream(rid, label, conn, owner, fp, frame)
        conn.streams[rid] = stream
        try:
            await self._send(conn, frame)
        except BaseException:
            conn.streams.pop(rid, None)
            raise
        return stream

    async def cancel(self, stream: RequestStream) -> None:
        if stream.done:
            return
        await self._send(stream.conn, p.encode(p.CANCEL, rids=[stream.rid]))

    def find_stream(self, rid: str, allowed=None) -> RequestStream | None:
        """The stream with this routing id or client-visible id that `allowed` (a predicate on
        streams, e.g. "made by this key") admits; the oldest when several do."""
        for conn in self.conns.values():
            for stream in conn.streams.values():
                if rid in (stream.rid, stream.label) and (allowed is None or allowed(stream)):
                    return stream
        return None

    async def call(self, conn: WorkerConn, op: str, args: dict | None = None, timeout: float = 10.0) -> dict:
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[cid] = fut
        self._call_conns[cid] = conn
        try:
            await self._send(conn, p.encode(p.CALL, cid=cid, op=op, args=args or {}))
            reply = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"worker for {conn.model} did not answer") from None
        finally:
            self._replies.pop(cid, None)
            self._call_conns.pop(cid, None)
        if not reply.get("ok"):
            error = reply.get("error")
            raise ServiceError.from_wire(error if isinstance(error, dict) else {})
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    async def shutdown_worker(self, conn: WorkerConn, drain: bool = True) -> None:
        """Ask a worker (a remote one: local ones get SIGTERM) to finish its requests and exit."""
        conn.state = ConnState.DRAINING
        try:
            await self._send(conn, p.encode(p.SHUTDOWN, drain=drain))
        except ServiceError:
            pass  # already gone

    async def _send(self, conn: WorkerConn, frame: bytes) -> None:
        try:
            await (conn.sock or self.sock).send_multipart([conn.identity, frame])
        except zmq.ZMQError:
            # EHOSTUNREACH: no peer under this identity now. It may be reconnecting (a worker
            # that thought the gateway gone comes back under a new identity and keeps its
            # requests), so route nothing new to it and let liveness judge it.
            conn.reachable = False
            raise ServiceError(ErrorCode.WORKER_LOST, f"the worker for {conn.model} is not reachable") from None

    async def _reply(self, sock: zmq.asyncio.Socket, identity: bytes, frame: bytes) -> None:
        try:
            await sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer left already

    # -- incoming --------------------------------------------------------------------------------
    async def _recv_loop(self, sock: zmq.asyncio.Socket, remote: bool) -> None:
        # Frames that have already arrived are taken with plain non-blocking reads of the same
        # socket: pyzmq's asyncio path costs a future, callbacks and flag arithmetic per frame.
        plain = zmq.Socket.shadow(sock.underlying)
        while True:
            await self._take(sock, remote, await sock.recv_multipart())
            while True:
                try:
                    frames = plain.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._take(sock, remote, frames)

    async def _take(self, sock: zmq.asyncio.Socket, remote: bool, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._reject("frames", "dropped a message with %d frames", len(frames))
            return
        identity, frame = frames
        try:
            msg = p.decode(frame, p.WORKER_TYPES)
            await self._dispatch(sock, remote, identity, msg)
        except p.VersionMismatch as e:
            self.dropped_messages += 1
            if identity not in self._refused_versions:  # once per worker, not per heartbeat
                self._refused_versions.add(identity)
                log.error(
                    "refused worker %s for model %s: it speaks protocol version %r, this gateway %d; "
                    "run the same mlxgw version on both",
                    e.msg.get("worker_id"), e.msg.get("model"), e.version, p.PROTOCOL_VERSION,
                )  # fmt: skip
        except p.ProtocolError as e:
            self._reject("protocol", "dropped message from worker: %s", e)
        except Exception:  # a bug in handling one message must not stop the broker
            self.dropped_messages += 1
            log.exception("error handling a worker message")

    def _reject(self, kind: str, message: str, *args) -> None:
        self.dropped_messages += 1
        self._rejects.warning(kind, message, *args)

    async def _dispatch(self, sock: zmq.asyncio.Socket, remote: bool, identity: bytes, msg: dict) -> None:
        kind = msg["t"]
        if kind == p.HELLO:
            await self._on_hello(sock, remote, identity, msg)
            return
        conn = self.conns.get(identity)
        if conn is None:
            # A worker we do not know (gateway restarted, or declared it dead): ask it to
            # announce itself again instead of acting on its messages.
            await self._reply(sock, identity, p.encode(p.RECONNECT))
            return
        conn.last_heard = time.monotonic()
        if not conn.reachable:
            conn.reachable = True
            self.events.put_nowait(WorkerBack(conn))
        if kind == p.HEARTBEAT:
            if "stats" in msg:
                conn.stats = wc.clean_stats(msg.get("stats"))
            conn.step_busy_s = wc.clean_busy(msg.get("step_busy_s"))
        elif kind == p.EVENTS:
            self._on_events(conn, msg.get("items"))
        elif kind == p.READY:
            if conn.state is ConnState.LOADING:
                conn.state = ConnState.READY
            conn.info = wc.clean_info(msg.get("info"))
            self.events.put_nowait(WorkerReady(conn))
        elif kind == p.REPLY:
            fut = self._replies.get(msg.get("cid")) if isinstance(msg.get("cid"), int) else None
            if fut and not fut.done():
                fut.set_result(msg)
        elif kind == p.LOAD_FAILED:
            error = msg.get("error") if isinstance(msg.get("error"), dict) else {}
            self.events.put_nowait(WorkerLoadFailed(conn, wc.short_text(error.get("message")) or "load failed"))
            self._depart(conn.worker_id)
            self.drop(conn, "model load failed", notify=False)
        elif kind == p.BYE:
            self._depart(conn.worker_id)
            self.drop(conn, "worker exited", planned=conn.state is ConnState.DRAINING)

    def _depart(self, worker_id: str) -> None:
        self._departed[worker_id] = None
        while len(self._departed) > 4096:
            self._departed.popitem(last=False)

    def _on_events(self, conn: WorkerConn, raw_items) -> None:
        items, bad = wc.event_items(raw_items)
        unknown = 0
        for rid, wire in items:
            stream = conn.streams.get(rid)
            if stream is None:
                continue  # request already ended gateway-side (client gone)
            # Decoded once, here: everything after the broker reads the event's attributes.
            event = p.event_from_wire(wire)
            if event is None:
                unknown += 1
                continue
            stream.push(event)
            if stream.done:
                del conn.streams[rid]
                if not conn.streams:
                    self.events.put_nowait(WorkerIdle(conn))
        if bad or unknown:
            self._reject("events", "dropped %d malformed events from worker %s", bad + unknown, conn.worker_id)

    async def _on_hello(self, sock: zmq.asyncio.Socket, remote: bool, identity: bytes, msg: dict) -> None:
        if self.secret and not hmac.compare_digest(str(msg.get("secret", "")).encode(), self.secret.encode()):
            self._reject(
                "secret", "refused worker %.64s for model %.64s: wrong secret", msg.get("worker_id"), msg.get("model")
            )
            return
        model, worker_id = msg.get("model"), msg.get("worker_id")
        if not isinstance(model, str) or not model or not isinstance(worker_id, str) or not worker_id:
            self._reject("hello", "dropped a hello without a model name or worker id")
            return
        if worker_id in self._departed:
            return  # on its way out: it said goodbye, or its process has exited
        pid = msg.get("pid")
        state = ConnState.READY if msg.get("state") == "ready" else ConnState.LOADING
        conn = WorkerConn(
            identity=identity,
            worker_id=worker_id[:64],
            model=model[:128],
            kind=msg.get("kind") if isinstance(msg.get("kind"), str) else "chat",
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            state=state,
            info=wc.clean_info(msg.get("info")),
            remote=remote,
            sock=sock,
            local_pid=None if remote else self._local.get(worker_id),
        )
        # The same worker under a new identity has reconnected (it thought we were gone):
        # it keeps its requests in flight, and nothing is dropped.
        for old in [c for c in self.conns.values() if c.worker_id == conn.worker_id and c.remote == remote]:
            del self.conns[old.identity]
            conn.streams.update(old.streams)
            for stream in conn.streams.values():
                stream.conn = conn
            if old.state is ConnState.DRAINING:
                conn.state = ConnState.DRAINING
        self.conns[identity] = conn
        await self._reply(sock, identity, p.encode(p.WELCOME))
        log.info("worker %s for %s connected (%s)", conn.worker_id, conn.model, conn.state)
        if conn.state is ConnState.READY:
            self.events.put_nowait(WorkerReady(conn))

    # -- liveness ------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        beat = p.encode(p.HEARTBEAT)
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            lag, last = now - last - self.heartbeat_s, now
            if lag > self.limits.loop_lag_s:
                self.host_stalls += 1
                log.warning(
                    "the gateway itself did not run for %.1f s (host stall or event-loop lag): "
                    "workers get a fresh liveness window instead of blame",
                    lag,
                )
                for conn in self.conns.values():
                    conn.last_heard = max(conn.last_heard, now)
            else:
                self._judge(now)
            for conn in list(self.conns.values()):
                try:
                    await (conn.sock or self.sock).send_multipart([conn.identity, beat], zmq.NOBLOCK)
                except zmq.ZMQError:
                    conn.reachable = False  # reconnecting, or gone: liveness decides which

    def _judge(self, now: float) -> None:
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
    ) -> list[str]:
        """Forget a worker: every request in flight on it ends with a worker_lost error.
        Returns the fingerprints of those requests. kind: why, for the fault counters."""
        if self.conns.get(conn.identity) is not conn:
            return []
        del self.conns[conn.identity]
        if planned:
            log.info("worker %s for %s left: %s", conn.worker_id, conn.model, reason)
        else:
            log.warning("lost worker %s for %s: %s", conn.worker_id, conn.model, reason)
        err = ServiceError(
            ErrorCode.WORKER_LOST, f"the worker serving {conn.model} stopped ({reason}); retry the request"
        )
        fps = [s.fingerprint for s in conn.streams.values()]
        if kind is live.LossKind.EXITED and conn.worker_id in self._local:
            # a crash of a local process: its exit code decides whether these were to blame
            self._exited_fps.setdefault(conn.worker_id, []).extend(fps)
        for stream in conn.streams.values():
            stream.push(p.Error(err))
        conn.streams.clear()
        for cid in [c for c, on in self._call_conns.items() if on is conn]:  # calls may wait long (tokenize)
            fut = self._replies.get(cid)
            if fut is not None and not fut.done():
                fut.set_result({"ok": False, "error": err.to_wire()})
        conn.state = ConnState.LOST
        if notify:
            self.events.put_nowait(WorkerLost(conn, reason, tuple(fps), kind))
        return fps
