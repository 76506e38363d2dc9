"""The gateway's broker against a worker link that misbehaves in the ways a real one can:
it replaced its socket and frames went with the old one, a frame went missing in transit,
it left (a reload's drain) before reading a request, or it heartbeats without ever
answering. The peer is a real ZeroMQ DEALER speaking the wire protocol frame by frame, so
each fault happens exactly, every time (with a real worker they are races).

Each test failed before its fix: the streams moved to a new identity as if nothing had
been lost, a gap went unnoticed, a reload's unread request ended in worker_lost (a 502),
and a request on a worker that heartbeats but never answers stayed open until it left."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from mlxgw.gateway.link.broker import Broker
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode
from mlxgw.shared.events import Accepted, Delta, Error, Finish, FinishReason, Usage

HEARTBEAT_S = 0.1


class RawWorker:
    """One worker link, frame by frame: HELLO, heartbeats on request, numbered EVENTS."""

    def __init__(self, endpoint: str, worker_id: str, seq: int = 0):
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.worker_id = worker_id
        self.hello_seq = seq
        self.progress: int | None = 0
        self._beats: asyncio.Task | None = None

    async def hello(self) -> None:
        await self.sock.send(
            p.encode(p.HELLO, worker_id=self.worker_id, model="m", kind="chat", pid=os.getpid(), state="ready",
                     seq=self.hello_seq)
        )  # fmt: skip
        assert (await self.recv())["t"] == p.WELCOME

    def beat(self, advance: bool = False) -> None:
        """Heartbeat from now on; advance: the progress count moves with every beat."""

        async def loop() -> None:
            while True:
                fields = {} if self.progress is None else {"progress": self.progress}
                await self.sock.send(p.encode(p.HEARTBEAT, state="ready", stats={}, step_busy_s=0.0, **fields))
                if advance and self.progress is not None:
                    self.progress += 1
                await asyncio.sleep(HEARTBEAT_S)

        self._beats = asyncio.create_task(loop())

    async def recv(self, kind: str | None = None) -> dict:
        """The next gateway message (of this kind: heartbeats and the rest skipped)."""
        while True:
            msg = p.decode(await asyncio.wait_for(self.sock.recv(), 5), p.GATEWAY_TYPES)
            if kind is None or msg["t"] == kind:
                return msg

    async def events(self, seq: int, *items) -> None:
        await self.sock.send(p.encode(p.EVENTS, items=list(items), seq=seq))

    def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        self.sock.close(0)


@pytest_asyncio.fixture(loop_scope="function")
async def broker():
    folder = tempfile.mkdtemp(prefix="gw")  # short: a unix socket's path has ~100 bytes
    b = Broker(f"ipc://{folder}/gw.sock", heartbeat_s=HEARTBEAT_S, liveness=5, hang_timeout_s=1.5)
    await b.start()
    yield b
    await b.close()
    shutil.rmtree(folder, ignore_errors=True)


async def _worker(broker: Broker, worker_id: str | None = None, seq: int = 0) -> RawWorker:
    w = RawWorker(broker.endpoint, worker_id or uuid.uuid4().hex, seq)
    await w.hello()
    w.beat()
    return w


async def _submit(broker: Broker, w: RawWorker):
    conn = next(c for c in broker.conns.values() if c.worker_id == w.worker_id)
    stream = await broker.submit(conn, p.GenerateRequest(rid="req", prompt="hi"))
    rid = (await w.recv(p.GENERATE))["request"]["rid"]
    return stream, rid


ACCEPTED = Accepted(prompt_tokens=1, max_tokens=8, queued=1).to_wire()


def _finish() -> dict:
    return Finish(reason=FinishReason.STOP, usage=Usage(), text="").to_wire()


async def test_a_worker_back_under_a_new_socket_with_frames_lost_ends_its_streams_with_an_error(broker):
    old = await _worker(broker)
    stream, rid = await _submit(broker, old)
    await old.events(0, [rid, ACCEPTED])
    assert type(await stream.next(5)) is Accepted
    old.close()  # frame 1 (a delta) went down with this socket
    new = await _worker(broker, old.worker_id, seq=2)
    event = await stream.next(5)
    assert type(event) is Error and event.error.code is ErrorCode.WORKER_LOST, event
    assert "lost part of this answer" in event.error.message
    assert (await new.recv(p.CANCEL))["rids"] == [rid]  # the worker stops generating for nobody
    assert broker.pool.in_flight("m") == 0
    new.close()


async def test_a_worker_back_under_a_new_socket_with_nothing_lost_keeps_its_streams(broker):
    old = await _worker(broker)
    stream, rid = await _submit(broker, old)
    await old.events(0, [rid, ACCEPTED])
    assert type(await stream.next(5)) is Accepted
    old.close()
    new = await _worker(broker, old.worker_id, seq=1)
    await new.events(1, [rid, _finish()])
    assert type(await stream.next(5)) is Finish
    assert broker.pool.in_flight("m") == 0
    new.close()


async def test_a_gap_in_a_workers_event_frames_ends_the_streams_it_may_have_cut(broker):
    w = await _worker(broker)
    stream, rid = await _submit(broker, w)
    await w.events(0, [rid, ACCEPTED])
    await w.events(2, [rid, Delta(text="late", n=2).to_wire()])  # frame 1 never arrived
    assert type(await stream.next(5)) is Accepted
    event = await stream.next(5)
    assert type(event) is Error and event.error.code is ErrorCode.WORKER_LOST, event
    assert (await w.recv(p.CANCEL))["rids"] == [rid]
    assert broker.pool.in_flight("m") == 0
    w.close()


async def test_a_request_a_draining_worker_left_unread_is_retryable_not_lost(broker):
    """SIGTERM makes an idle worker's engine leave its loop; a request that reached its link
    after the engine's last poll was never read, and the BYE then ended it as worker_lost
    (502) in the middle of a reload."""
    w = await _worker(broker)
    broker.registry.drain_local(w.worker_id)  # the reload's unload marks it draining, then SIGTERMs it
    stream, _ = await _submit(broker, w)  # it was routed there in the instant before
    await w.sock.send(p.encode(p.BYE))
    event = await stream.next(5)
    assert type(event) is Error and event.error.code is ErrorCode.MODEL_UNAVAILABLE, event
    w.close()


async def test_a_request_a_draining_worker_took_in_still_ends_as_lost(broker):
    w = await _worker(broker)
    broker.registry.drain_local(w.worker_id)
    stream, rid = await _submit(broker, w)
    await w.events(0, [rid, ACCEPTED])
    await w.sock.send(p.encode(p.BYE))
    assert type(await stream.next(5)) is Accepted
    event = await stream.next(5)
    assert type(event) is Error and event.error.code is ErrorCode.WORKER_LOST, event  # it may have run
    w.close()


async def test_a_worker_that_heartbeats_without_progress_loses_its_requests_past_the_hang_bound(broker):
    w = await _worker(broker)
    stream, _ = await _submit(broker, w)
    event = await stream.next(6)  # hang_timeout_s 1.5 s
    assert type(event) is Error and "made no progress" in event.error.message, event
    assert broker.pool.in_flight("m") == 0
    w.close()


async def test_a_slow_worker_whose_progress_moves_keeps_its_requests(broker):
    w = RawWorker(broker.endpoint, uuid.uuid4().hex)
    await w.hello()
    w.beat(advance=True)  # a long prefill: no event for seconds, but its layer groups advance
    stream, rid = await _submit(broker, w)
    with pytest.raises(TimeoutError):
        await stream.next(3)  # twice the hang bound
    await w.events(0, [rid, ACCEPTED])
    assert type(await stream.next(5)) is Accepted
    w.close()


async def test_an_idle_worker_that_heartbeats_without_progress_is_kept(broker):
    w = await _worker(broker)
    await asyncio.sleep(2)  # past the hang bound, with nothing in flight
    assert any(c.worker_id == w.worker_id for c in broker.conns.values())
    w.close()


async def test_a_drained_workers_last_frames_are_read_though_its_exit_is_seen_first(broker):
    """The other half of the draining worker: a drained worker sends its finishes and BYE, then
    exits; on a busy host the lifecycle saw the exit while those frames still waited unread,
    and the requests that had been answered ended as worker_lost (502)."""
    w = await _worker(broker)
    broker.registry.drain_local(w.worker_id)
    stream, rid = await _submit(broker, w)
    # No await below yields to the broker's receive loop: the frames are sent but unread
    # when the exit is reported, which is the race, every time.
    await w.events(0, [rid, ACCEPTED], [rid, _finish()])
    await w.sock.send(p.encode(p.BYE))
    broker.registry.release_local(w.worker_id, "process exited with code 0", planned=True)
    assert type(await stream.next(5)) is Accepted
    assert type(await stream.next(5)) is Finish
    assert broker.pool.in_flight("m") == 0
    w.close()


async def test_a_worker_asked_to_stop_before_its_hello_is_never_routed_to(broker):
    """A reload that comes while a model's worker is starting drains it before it has said
    HELLO; its READY must not make it a worker that new requests go to."""
    worker_id = uuid.uuid4().hex
    broker.registry.drain_local(worker_id)
    w = await _worker(broker, worker_id)
    assert broker.pool.ready_workers("m") == [] and broker.pool.least_loaded("m") is None
    w.close()


async def test_a_worker_that_leaves_unasked_retries_the_requests_it_never_read(broker):
    w = await _worker(broker)
    stream, _ = await _submit(broker, w)
    await w.sock.send(p.encode(p.BYE))  # a remote worker's operator stopped it: it read nothing more
    event = await stream.next(5)
    assert type(event) is Error and event.error.code is ErrorCode.MODEL_UNAVAILABLE, event
    w.close()
