"""The gateway's end of the ZeroMQ link: a small Majordomo broker.

One ROUTER socket for local workers (ipc), and one for remote workers when the gateway
listens for them (tcp, with a maximum message size so that nobody can send gigabytes
before authenticating). Workers connect DEALERs and announce the model they serve. The
broker heartbeats every worker, routes requests under ids it generates itself, and fans the
batched events back out to per-request streams. It owns, besides the sockets, the records of
its workers (`registry`: connections, local processes, liveness judgement, ending a lost
worker's requests; gateway/link/worker_registry.py) and the choice of a worker for each
request (`pool`: gateway/link/pool.py). A worker lost with requests in flight ends each of them with
an explicit error event: streams end exactly once, never by hanging and never with a hole.

What the model manager needs to hear (a worker ready, failed to load, lost, idle) is put
on `events`, a queue the manager consumes: the broker holds no reference to the manager."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time

import zmq
import zmq.asyncio

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Error, event_from_wire
from . import liveness as live
from . import wire_checks as wc
from .broker_wire import (
    MAX_WIRE_DEPTH,
    REMOTE_MAX_MESSAGE_BYTES,
    RateLimitedLog,
    encoding_error,
    nested_deeper_than,
)
from .pool import Pool
from .quarantine import fingerprint
from .worker_conn import ConnState, RequestStream, WorkerBack, WorkerConn, WorkerIdle, WorkerLoadFailed, WorkerReady
from .worker_registry import WorkerRegistry

log = logging.getLogger(__name__)


class Broker:
    """The sockets and the wire; what it knows about each worker is its registry's, which
    worker a request goes to its pool's."""

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
        self.registry = WorkerRegistry(live.Limits(heartbeat_s * liveness, hang_timeout_s), self._fail_calls)
        self.conns = self.registry.conns  # the same dict: identity -> WorkerConn
        self.pool = Pool(self.conns)
        self.secret = secret
        self.remote_max_message_bytes = remote_max_message_bytes
        self.dropped_messages = 0
        self._replies: dict[int, asyncio.Future] = {}
        self._call_conns: dict[int, WorkerConn] = {}  # the worker each pending call went to
        self._cids = itertools.count(1)
        self._rids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._rejects = RateLimitedLog()
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
        tasks = [*self._tasks, *self.registry.lingering]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = sum(c.load for c in self.conns.values())
        if left:
            log.error("%d requests were still in flight at shutdown; ending them with an error", left)
        for conn in list(self.conns.values()):
            self.registry.drop(conn, "gateway shutting down", notify=False, planned=True)
        for sock in (self.sock, self.remote_sock):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()

    # -- routing ------------------------------------------------------------------------------
    async def submit(self, conn: WorkerConn, req: p.WorkerRequest, owner: str | None = None) -> RequestStream:
        """Send a request under a fresh routing id. Encoding and the quarantine check happen
        before the stream is registered: a refused request leaves nothing behind."""
        label = req.rid
        rid = f"{label}#{next(self._rids)}"
        try:
            wire = req.to_wire()
            wire["rid"] = rid
            if nested_deeper_than(wire, MAX_WIRE_DEPTH):
                raise RecursionError("the request is nested too deeply")
            frame = p.encode(req.WIRE_TYPE, request=wire)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            raise encoding_error(e) from None
        fp = None  # computed when a crash needs it (RequestStream.fingerprint), or now to check it
        quarantine = self.registry.quarantine
        if quarantine.watching(conn.model):
            fp = fingerprint(wire)
            quarantine.check(conn.model, fp)
        stream = RequestStream(rid, label, conn, owner, fp, frame)
        if not conn.streams:
            conn.progress_at = time.monotonic()  # no progress is owed before there is work
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
        stream.cancelled = True  # a cancel that finds no peer goes again when the worker is back
        await self._send(stream.conn, p.encode(p.CANCEL, rids=[stream.rid]))

    async def stop(self, stream: RequestStream) -> None:
        """Stop the worker generating for a stream the gateway has ended itself (its terminal
        event given here, as when a newer request supersedes it)."""
        stream.cancelled = True
        await self._cancel_rids(stream.conn, [stream.rid])

    async def _cancel_rids(self, conn: WorkerConn, rids: list[str]) -> None:
        """Stop the worker generating for requests the gateway has already ended."""
        if rids:
            try:
                await self._send(conn, p.encode(p.CANCEL, rids=rids))
            except ServiceError:
                pass  # not reachable now; liveness decides what it is

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
            self.registry.events.put_nowait(WorkerBack(conn))
            await self._cancel_rids(conn, [rid for rid, s in conn.streams.items() if s.cancelled])
        if kind == p.HEARTBEAT:
            if "stats" in msg:
                conn.stats = wc.clean_stats(msg.get("stats"))
            conn.step_busy_s = wc.clean_busy(msg.get("step_busy_s"))
            progress = msg.get("progress")
            if isinstance(progress, int) and not isinstance(progress, bool) and progress != conn.progress:
                conn.progress, conn.progress_at = progress, conn.last_heard
        elif kind == p.EVENTS:
            conn.progress_at = conn.last_heard
            lost = self.registry.check_seq(conn, msg.get("seq"))
            self._on_events(conn, msg.get("items"))
            await self._cancel_rids(conn, lost)
        elif kind == p.READY:
            if conn.state is ConnState.LOADING:
                conn.state = ConnState.READY
            conn.info = wc.clean_info(msg.get("info"))
            self.registry.events.put_nowait(WorkerReady(conn))
        elif kind == p.PREFIXES:  # what its prefix cache holds: the pool's index follows it
            held, evicted = wc.prefix_entries(msg.get("held")), wc.prefix_entries(msg.get("evicted"))
            self.pool.reported(conn, held, evicted, msg.get("snapshot") is True)
        elif kind == p.REPLY:
            fut = self._replies.get(msg.get("cid")) if isinstance(msg.get("cid"), int) else None
            if fut and not fut.done():
                fut.set_result(msg)
        elif kind == p.LOAD_FAILED:
            error = msg.get("error") if isinstance(msg.get("error"), dict) else {}
            why = wc.short_text(error.get("message")) or "load failed"
            self.registry.events.put_nowait(WorkerLoadFailed(conn, why))
            self.registry.depart(conn.worker_id)
            self.registry.drop(conn, "model load failed", notify=False)
        elif kind == p.BYE:
            self.registry.depart(conn.worker_id)
            self.registry.drop(conn, "worker exited", planned=conn.state is ConnState.DRAINING, graceful=True)

    def _on_events(self, conn: WorkerConn, raw_items) -> None:
        items, bad = wc.event_items(raw_items)
        unknown = 0
        for rid, wire in items:
            stream = conn.streams.get(rid)
            if stream is None:
                continue  # request already ended gateway-side (client gone)
            # Decoded once, here: everything after the broker reads the event's attributes.
            event = event_from_wire(wire)
            if event is None:
                unknown += 1
                continue
            stream.push(event)
            if stream.done:
                self._ended(conn, event)
                del conn.streams[rid]
                if not conn.streams:
                    self.registry.events.put_nowait(WorkerIdle(conn))
        if bad or unknown:
            self._reject("events", "dropped %d malformed events from worker %s", bad + unknown, conn.worker_id)

    async def _on_hello(self, sock: zmq.asyncio.Socket, remote: bool, identity: bytes, msg: dict) -> None:
        if self.secret and not hmac.compare_digest(str(msg.get("secret", "")).encode(), self.secret.encode()):
            self._reject(
                "secret", "refused worker %.64s for model %.64s: wrong secret", msg.get("worker_id"), msg.get("model")
            )
            return
        worker_id = msg.get("worker_id")
        local_pid, label = (None, "") if remote else self.registry.local_process(str(worker_id))
        conn = wc.conn_from_hello(msg, identity, remote, sock, local_pid, label)
        if conn is None:
            self._reject("hello", "dropped a hello without a model name or worker id")
            return
        if self.registry.departed(conn.worker_id):
            return  # on its way out: it said goodbye, or its process has exited
        lost = self.registry.register(conn, msg.get("seq"))
        await self._reply(sock, identity, p.encode(p.WELCOME))
        log.info("worker %s for %s connected (%s)", conn.worker_id, conn.model, conn.state)
        if conn.state is ConnState.READY:
            self.registry.events.put_nowait(WorkerReady(conn))
        await self._cancel_rids(conn, lost)  # cancels the old identity may have missed

    # -- liveness ------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        beat = p.encode(p.HEARTBEAT)
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            lag, last = now - last - self.heartbeat_s, now
            if lag > self.registry.limits.loop_lag_s:
                self.registry.host_stalls += 1
                log.warning(
                    "the gateway itself did not run for %.1f s (host stall or event-loop lag): "
                    "workers get a fresh liveness window instead of blame",
                    lag,
                )
                self.registry.forgive_stall(now)
            else:
                self.registry.judge(now)
            for conn in list(self.conns.values()):
                try:
                    await (conn.sock or self.sock).send_multipart([conn.identity, beat], zmq.NOBLOCK)
                except zmq.ZMQError:
                    conn.reachable = False  # reconnecting, or gone: liveness decides which

    def _fail_calls(self, conn: WorkerConn, err: ServiceError) -> None:
        for cid in [c for c, on in self._call_conns.items() if on is conn]:  # calls may wait long (tokenize)
            fut = self._replies.get(cid)
            if fut is not None and not fut.done():
                fut.set_result({"ok": False, "error": err.to_wire()})

    def _ended(self, conn: WorkerConn, event) -> None:
        """A request's last event: its replica's hit rate, or a failure for its breaker."""
        if type(event) is Error:
            self.pool.failed(conn, event.error.code)
        elif event.usage is not None:
            self.pool.finished(conn, event.usage.prompt_tokens, event.usage.cached_tokens)
