"""The gateway's end of the ZeroMQ link: a small Majordomo broker.

One ROUTER socket; workers connect DEALERs and announce the model they serve. The broker
keeps a connection record per worker, heartbeats every one, declares a worker dead when
it is silent for `liveness` heartbeats (or hung inside one engine step too long), routes
requests, and fans the batched events back out to per-request streams. A worker lost
with requests in flight ends each of them with an explicit error event: streams end
exactly once, never by hanging."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError

log = logging.getLogger("mlxgw.broker")

TERMINAL = (p.EV_FINISH, p.EV_ERROR)


class RequestStream:
    """Events of one request, in order; ends with exactly one finish or error."""

    def __init__(self, rid: str, conn: WorkerConn, owner: str | None = None):
        self.rid = rid
        self.conn = conn
        self.owner = owner  # the API key's name, when keys are on: who may cancel it
        self.done = False
        self._queue: asyncio.Queue[dict] = asyncio.Queue()

    def push(self, event: dict) -> None:
        if self.done:
            return
        if event.get("e") in TERMINAL:
            self.done = True
        self._queue.put_nowait(event)

    async def next(self, timeout: float | None = None) -> dict:
        return await asyncio.wait_for(self._queue.get(), timeout)


@dataclass
class WorkerConn:
    identity: bytes
    worker_id: str
    model: str
    kind: str
    pid: int | None
    state: str = "loading"
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    last_heard: float = field(default_factory=time.monotonic)
    step_busy_s: float = 0.0
    streams: dict[str, RequestStream] = field(default_factory=dict)

    @property
    def load(self) -> int:
        return len(self.streams)


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
    ):
        self.endpoint = endpoint
        self.extra_endpoints = extra_endpoints  # e.g. tcp:// for remote workers
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.hang_timeout_s = hang_timeout_s
        self.secret = secret
        self.conns: dict[bytes, WorkerConn] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._cids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        # Callbacks set by the model manager.
        self.on_ready: Callable[[WorkerConn], None] = lambda c: None
        self.on_lost: Callable[[WorkerConn, str], None] = lambda c, r: None
        self.on_load_failed: Callable[[WorkerConn, dict], None] = lambda c, e: None
        self.dropped_messages = 0
        self._refused_versions: set[bytes] = set()

    async def start(self) -> None:
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends raise, not vanish
        self.sock.bind(self.endpoint)
        for extra in self.extra_endpoints:
            self.sock.bind(extra)
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="broker-recv"),
            asyncio.create_task(self._heartbeat_loop(), name="broker-heartbeat"),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in list(self.conns.values()):
            self.drop(conn, "gateway shutting down")
        self.sock.close(linger=0)
        self.ctx.term()

    # -- routing ------------------------------------------------------------------------------
    def ready_workers(self, model: str) -> list[WorkerConn]:
        return [c for c in self.conns.values() if c.model == model and c.state == "ready"]

    def least_loaded(self, model: str) -> WorkerConn | None:
        ready = self.ready_workers(model)
        return min(ready, key=lambda c: c.load) if ready else None

    async def submit(
        self, conn: WorkerConn, req: p.WorkerRequest, owner: str | None = None
    ) -> RequestStream:
        stream = RequestStream(req.rid, conn, owner)
        conn.streams[req.rid] = stream
        await self._send(conn, p.encode(req.WIRE_TYPE, request=req.to_wire()))
        return stream

    async def cancel(self, stream: RequestStream) -> None:
        if stream.done:
            return
        await self._send(stream.conn, p.encode(p.CANCEL, rids=[stream.rid]))

    def find_stream(self, rid: str) -> RequestStream | None:
        for conn in self.conns.values():
            if rid in conn.streams:
                return conn.streams[rid]
        return None

    async def call(self, conn: WorkerConn, op: str, args: dict | None = None, timeout: float = 10.0) -> dict:
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[cid] = fut
        try:
            await self._send(conn, p.encode(p.CALL, cid=cid, op=op, args=args or {}))
            reply = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"worker for {conn.model} did not answer") from None
        finally:
            self._replies.pop(cid, None)
        if not reply.get("ok"):
            raise ServiceError.from_wire(reply.get("error") or {})
        return reply.get("result") or {}

    async def shutdown_worker(self, conn: WorkerConn, drain: bool = True) -> None:
        """Ask a worker (a remote one: local ones get SIGTERM) to finish its requests and exit."""
        conn.state = "draining"
        try:
            await self._send(conn, p.encode(p.SHUTDOWN, drain=drain))
        except ServiceError:
            pass  # already gone

    async def _send(self, conn: WorkerConn, frame: bytes) -> None:
        try:
            await self.sock.send_multipart([conn.identity, frame])
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone
            self.drop(conn, f"worker unreachable: {e}")
            raise ServiceError(ErrorCode.WORKER_LOST, f"worker for {conn.model} is gone") from None

    # -- incoming --------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                self.dropped_messages += 1
                log.warning("dropped a message with %d frames", len(frames))
                continue
            identity, frame = frames
            try:
                msg = p.decode(frame, p.WORKER_TYPES)
                self._dispatch(identity, msg)
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
                self.dropped_messages += 1
                log.warning("dropped message from worker: %s", e)
            except Exception:  # a bug in handling one message must not stop the broker
                self.dropped_messages += 1
                log.exception("error handling a worker message")

    def _dispatch(self, identity: bytes, msg: dict) -> None:
        kind = msg["t"]
        conn = self.conns.get(identity)
        if kind == p.HELLO:
            self._on_hello(identity, msg)
            return
        if conn is None:
            # A worker we do not know (gateway restarted, or declared it dead): ask it to
            # announce itself again instead of acting on its messages.
            asyncio.ensure_future(self.sock.send_multipart([identity, p.encode(p.RECONNECT)]))
            return
        conn.last_heard = time.monotonic()
        if kind == p.HEARTBEAT:
            conn.stats = msg.get("stats") or conn.stats
            conn.step_busy_s = float(msg.get("step_busy_s") or 0.0)
        elif kind == p.EVENTS:
            for rid, event in msg.get("items") or []:
                stream = conn.streams.get(rid)
                if stream is None:
                    continue  # request already ended gateway-side (client gone)
                stream.push(event)
                if stream.done:
                    conn.streams.pop(rid, None)
        elif kind == p.READY:
            conn.state, conn.info = "ready", msg.get("info") or {}
            self.on_ready(conn)
        elif kind == p.REPLY:
            fut = self._replies.get(msg.get("cid"))
            if fut and not fut.done():
                fut.set_result(msg)
        elif kind == p.LOAD_FAILED:
            self.on_load_failed(conn, msg.get("error") or {})
            self.drop(conn, "model load failed", notify=False)
        elif kind == p.BYE:
            self.drop(conn, "worker exited")

    def _on_hello(self, identity: bytes, msg: dict) -> None:
        if self.secret and not hmac.compare_digest(str(msg.get("secret", "")), self.secret):
            log.warning("refused worker %s for model %s: wrong secret", msg.get("worker_id"), msg.get("model"))
            return
        model = msg.get("model")
        if not isinstance(model, str):
            log.warning("dropped hello without a model name")
            return
        conn = WorkerConn(
            identity=identity,
            worker_id=str(msg.get("worker_id")),
            model=model,
            kind=str(msg.get("kind", "chat")),
            pid=msg.get("pid"),
            state=str(msg.get("state", "loading")),
            info=msg.get("info") or {},
        )
        old = self.conns.get(identity)
        if old is not None:
            conn.streams = old.streams
        self.conns[identity] = conn
        asyncio.ensure_future(self.sock.send_multipart([identity, p.encode(p.WELCOME)]))
        log.info("worker %s for %s connected (%s)", conn.worker_id, model, conn.state)
        if conn.state == "ready":
            self.on_ready(conn)

    # -- liveness ------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        beat = p.encode(p.HEARTBEAT)
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            for conn in list(self.conns.values()):
                silent = now - conn.last_heard
                if silent > self.heartbeat_s * self.liveness:
                    self.drop(conn, f"worker silent for {silent:.1f} s")
                elif conn.step_busy_s > self.hang_timeout_s:
                    self.drop(conn, f"worker hung in one step for {conn.step_busy_s:.0f} s")
                else:
                    try:
                        await self.sock.send_multipart([conn.identity, beat], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        self.drop(conn, "worker unreachable")

    def drop(self, conn: WorkerConn, reason: str, notify: bool = True) -> None:
        """Forget a worker: every request in flight on it ends with a worker_lost error."""
        if self.conns.get(conn.identity) is not conn:
            return
        del self.conns[conn.identity]
        log.warning("lost worker %s for %s: %s", conn.worker_id, conn.model, reason)
        err = ServiceError(
            ErrorCode.WORKER_LOST, f"the worker serving {conn.model} stopped ({reason}); retry the request"
        )
        for stream in conn.streams.values():
            stream.push(p.error_event(err))
        conn.streams.clear()
        conn.state = "lost"
        if notify:
            self.on_lost(conn, reason)
