"""The model lifecycle as a state machine, against a fake broker link and a fake spawner:
load, crash, restart backoff, crash loop, drain, evict, reload, quarantine. No processes
and no sockets: each test is milliseconds. The end-to-end versions with real workers are
in test_residency.py and test_resilience.py."""

from __future__ import annotations

import asyncio
import itertools
import signal
import uuid

import pytest

from mlxgw.gateway.link.broker import Broker
from mlxgw.gateway.link.worker_conn import ConnState, WorkerConn, WorkerLost, WorkerReady
from mlxgw.gateway.models.lifecycle import SlotState
from mlxgw.gateway.models.manager import ModelManager
from mlxgw.gateway.models.model_report import describe_slot
from mlxgw.shared import protocol as p
from mlxgw.shared.config import parse_registry
from mlxgw.shared.errors import ErrorCode, ServiceError
from mlxgw.shared.events import Delta, EventKind, Finish, FinishReason, Usage

PIDS = itertools.count(900000)


class FakeLinkBroker(Broker):
    """The real broker's routing and bookkeeping with the sockets left out: frames it would
    send are kept in `sent`."""

    def __init__(self) -> None:
        super().__init__("inproc://unused", heartbeat_s=0.05, liveness=4)
        self.sent: list[tuple[str, bytes]] = []

    async def _send(self, conn: WorkerConn, frame: bytes) -> None:
        self.sent.append((conn.worker_id, frame))

    def connect(self, worker_id: str, model: str) -> WorkerConn:
        conn = WorkerConn(identity=worker_id.encode(), worker_id=worker_id, model=model, kind="chat", pid=None)
        conn.local_pid, conn.replica.label = self.registry.local_process(worker_id)
        self.conns[conn.identity] = conn
        return conn

    def ready(self, conn: WorkerConn) -> None:
        conn.state = ConnState.READY
        conn.info = {"context_length": 64, "load_seconds": 0.01}
        self.registry.events.put_nowait(WorkerReady(conn))

    def close_now(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class FakeProcess:
    """A worker process: connects and turns ready after `load_s` unless told to crash; SIGTERM
    drains for `drain_s`, SIGKILL ends it at once."""

    def __init__(self, spawner: FakeSpawner, model: str, behaviour: str):
        self.spawner = spawner
        self.model = model
        self.worker_id = uuid.uuid4().hex
        self.pid = next(PIDS)
        self.signals: list[int] = []
        self._exit: asyncio.Future = asyncio.get_running_loop().create_future()
        self.conn: WorkerConn | None = None
        asyncio.get_running_loop().call_later(spawner.load_s, self._loaded, behaviour)

    def _loaded(self, behaviour: str) -> None:
        if not self.running:
            return
        if behaviour == "crash":
            self.exit(3)
            return
        self.conn = self.spawner.broker.connect(self.worker_id, self.model)
        if behaviour == "ready":
            self.spawner.broker.ready(self.conn)

    @property
    def running(self) -> bool:
        return not self._exit.done()

    def exit(self, code: int) -> None:
        if self.running:
            self._exit.set_result(code)
            self.spawner.alive.discard(self)

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.exit(-9)
        elif sig == signal.SIGTERM:
            asyncio.get_running_loop().call_later(self.spawner.drain_s, self.exit, 0)

    async def stop(self, grace_s: float) -> int:
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait(), grace_s)
        except asyncio.TimeoutError:
            self.signal(signal.SIGKILL)
            return await self.wait()


class FakeSpawner:
    def __init__(self, broker: FakeLinkBroker, script: dict[str, list[str]] | None = None):
        self.broker = broker
        self.script = script or {}  # model -> behaviours of its next spawns; then "ready"
        self.load_s = 0.01
        self.drain_s = 0.01
        self.spawned: list[FakeProcess] = []
        self.alive: set[FakeProcess] = set()
        self.most_alive: dict[str, int] = {}  # per model: the most processes alive at once
        self.most_alive_total = 0

    async def __call__(self, endpoint, entry, path, *, heartbeat_s, liveness, **_) -> FakeProcess:
        behaviours = self.script.get(entry.name) or []
        proc = FakeProcess(self, entry.name, behaviours.pop(0) if behaviours else "ready")
        self.spawned.append(proc)
        self.alive.add(proc)
        same = sum(1 for q in self.alive if q.model == entry.name)
        self.most_alive[entry.name] = max(self.most_alive.get(entry.name, 0), same)
        self.most_alive_total = max(self.most_alive_total, len(self.alive))
        return proc

    def of(self, model: str) -> list[FakeProcess]:
        return [q for q in self.spawned if q.model == model]


def registry(models: list[dict], **manager):
    return parse_registry({"manager": {"auto_discover": False, **manager}, "models": models})


ECHO = [{"name": "a", "engine": "echo"}, {"name": "b", "engine": "echo"}, {"name": "c", "engine": "echo"}]


@pytest.fixture
async def world():
    made = []

    async def make(models=ECHO, script=None, **manager):
        broker = FakeLinkBroker()
        spawner = FakeSpawner(broker, script)
        manager_ = ModelManager(registry(models, **{"restart_backoff_s": 0.02, **manager}), broker, spawner)
        await manager_.start()
        made.append((manager_, broker))
        return manager_, broker, spawner

    yield make
    for manager_, broker in made:
        await manager_.close()
        assert not manager_._tasks, "every background task ends with close()"
        broker.close_now()


async def until(predicate, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_concurrent_first_requests_share_one_load(world):
    manager, _, spawner = await world()
    slot = manager.slots["a"]
    conns = await asyncio.gather(*(manager.acquire(slot) for _ in range(6)))
    assert len({c.worker_id for c in conns}) == 1
    assert len(spawner.of("a")) == 1 and slot.loads == 1
    assert slot.state is SlotState.READY


async def test_a_crash_restarts_with_backoff_and_counts_one_restart(world):
    manager, _, spawner = await world()
    slot = manager.slots["a"]
    await manager.acquire(slot)
    spawner.of("a")[0].exit(-9)
    await until(lambda: slot.state is SlotState.RESTARTING)
    conn = await manager.acquire(slot)
    assert conn.worker_id == spawner.of("a")[1].worker_id
    assert slot.restarts == 1 and len(slot.crashes.times) == 1
    assert slot.last_error is None  # ready again


async def test_a_crash_loop_fails_the_model_then_retries_after_the_long_backoff(world):
    manager, _, spawner = await world(script={"a": ["crash"] * 4}, failed_retry_s=0.3)
    slot = manager.slots["a"]
    with pytest.raises(ServiceError, match="failed"):
        await manager.acquire(slot)
    assert slot.state is SlotState.FAILED and "crash loop" in slot.last_error
    with pytest.raises(ServiceError, match="next try in"):
        await manager.acquire(slot)
    await until(lambda: slot.state is SlotState.UNLOADED)
    assert await manager.acquire(slot)  # the fifth spawn is healthy
    assert len(spawner.of("a")) == 5


async def test_reload_retries_a_failed_model_at_once(world):
    manager, _, _ = await world(script={"a": ["crash"] * 4}, failed_retry_s=1000)
    slot = manager.slots["a"]
    with pytest.raises(ServiceError):
        await manager.acquire(slot)
    assert slot.state is SlotState.FAILED
    await manager.reload(manager.registry)
    await until(lambda: slot.state is SlotState.UNLOADED)
    assert await manager.acquire(slot)


async def test_a_planned_unload_is_not_a_crash(world):
    manager, _, spawner = await world()
    slot = manager.slots["a"]
    await manager.acquire(slot)
    await manager.unload(slot, "test")
    assert slot.state is SlotState.UNLOADED
    assert slot.unloads == 1 and slot.restarts == 0 and not slot.crashes.times and slot.last_error is None
    assert spawner.of("a")[0].signals == [signal.SIGTERM]
    assert not spawner.alive


async def test_a_request_for_a_draining_model_waits_for_the_drain_then_loads_once(world):
    manager, _, spawner = await world()
    spawner.drain_s = 0.2
    slot = manager.slots["a"]
    await manager.acquire(slot)
    unloading = asyncio.create_task(manager.unload(slot, "test"))
    await until(lambda: slot.state is SlotState.DRAINING)
    conns = await asyncio.gather(*(manager.acquire(slot) for _ in range(4)))
    await unloading
    assert len(spawner.of("a")) == 2, "exactly one new load after the drain"
    assert {c.worker_id for c in conns} == {spawner.of("a")[1].worker_id}
    assert spawner.most_alive["a"] == 1, "the new worker started only after the old one exited"
    assert slot.restarts == 0


async def test_eviction_makes_room_by_a_planned_stop_of_the_least_recently_used(world):
    # echo workers are estimated at 128 MB: a 300 MB budget fits two
    manager, _, spawner = await world(memory_budget="300MB")
    a, b, c = (manager.slots[n] for n in "abc")
    await manager.acquire(a)
    await manager.acquire(b)
    await manager.acquire(c)
    assert a.state is SlotState.UNLOADED and b.state is SlotState.READY and c.state is SlotState.READY
    assert manager.residency.evictions == 1 and a.unloads == 1 and a.restarts == 0
    assert spawner.most_alive_total == 2


async def test_a_busy_model_is_not_evicted_and_the_load_waits_for_it(world):
    manager, broker, spawner = await world(memory_budget="200MB", wait_timeout_s=5)
    a, b = manager.slots["a"], manager.slots["b"]
    conn = await manager.acquire(a)
    stream = await broker.submit(conn, p.GenerateRequest(rid="busy", prompt="hi"))
    loading = asyncio.create_task(manager.acquire(b))
    await asyncio.sleep(0.1)
    assert not loading.done() and a.state is SlotState.READY
    broker._on_events(conn, [[stream.rid, {"e": EventKind.FINISH, "reason": "stop"}]])
    await loading
    assert a.state is SlotState.UNLOADED and spawner.most_alive_total == 1


async def test_a_ready_model_with_requests_waiting_for_it_is_not_evicted(world):
    """Residency: with room for one model, requests for three once thrashed (43 loads for
    9 requests in the three-model test, some past the wait timeout). A model turned ready; the
    other model's load, woken by the same event before the requests waiting for the first,
    evicted it before they could start. A model that requests wait for is not a victim."""
    manager, _, _ = await world(memory_budget="200MB")
    a, b = manager.slots["a"], manager.slots["b"]
    await manager.acquire(a)
    a.waiters = 1  # a request woken by a's load, not yet run
    assert manager.residency.plan(b, manager.occupants(b)).victim is None
    a.waiters = 0
    assert manager.residency.plan(b, manager.occupants(b)).victim is a


async def test_requests_for_two_models_that_do_not_fit_together_load_each_at_most_once_per_request(world):
    manager, broker, spawner = await world(memory_budget="200MB", wait_timeout_s=5, load_timeout_s=5)
    a, b = manager.slots["a"], manager.slots["b"]
    spawner.load_s = 0.05

    async def ask(slot, i: int) -> None:
        conn = await manager.acquire(slot)
        stream = await broker.submit(conn, p.GenerateRequest(rid=f"{slot.name}{i}", prompt="hi"))
        await asyncio.sleep(0.02)  # generating
        broker._on_events(conn, [[stream.rid, {"e": EventKind.FINISH, "reason": "stop"}]])

    await asyncio.wait_for(asyncio.gather(*(ask(s, i) for i in range(3) for s in (a, b))), 10)
    assert len(spawner.spawned) <= 6, [q.model for q in spawner.spawned]
    assert spawner.most_alive_total == 1 and a.waiters == b.waiters == 0


async def test_a_hot_reload_that_changes_a_model_drains_the_old_worker_before_loading_once(world):
    manager, _, spawner = await world()
    spawner.drain_s = 0.2
    await manager.acquire(manager.slots["a"])
    changed = registry([{**ECHO[0], "max_num_seqs": 2}, *ECHO[1:]])
    result = await manager.reload(changed)
    assert result["changed"] == ["a"]
    fresh = manager.slots["a"]
    conns = await asyncio.gather(*(manager.acquire(fresh) for _ in range(3)))
    assert len(spawner.of("a")) == 2 and len({c.worker_id for c in conns}) == 1
    assert spawner.most_alive["a"] == 1
    await until(lambda: not manager.retiring)


async def test_a_worker_lost_by_liveness_is_killed_and_restarted(world):
    manager, broker, spawner = await world()
    slot = manager.slots["a"]
    conn = await manager.acquire(slot)
    broker.registry.drop(conn, "worker silent for 9 s")
    await until(lambda: len(spawner.of("a")) == 2)
    assert spawner.of("a")[0].signals == [signal.SIGKILL]
    assert slot.restarts == 1


async def test_a_request_in_flight_at_two_crashes_is_quarantined(world):
    manager, broker, spawner = await world()
    slot = manager.slots["a"]
    poison = p.GenerateRequest(rid="p", prompt="the poison")
    for crash in range(2):
        conn = await manager.acquire(slot)
        await broker.submit(conn, p.GenerateRequest(rid="p", prompt="the poison"))
        if crash == 0:
            await broker.submit(conn, p.GenerateRequest(rid="i", prompt="an innocent"))
        spawner.of("a")[crash].exit(-11)
        await until(lambda n=crash: len(spawner.of("a")) == n + 2)
    conn = await manager.acquire(slot)
    with pytest.raises(ServiceError) as info:
        await broker.submit(conn, poison)
    assert info.value.code is ErrorCode.INVALID_REQUEST and "fingerprint" in info.value.message
    assert conn.load == 0
    assert await broker.submit(conn, p.GenerateRequest(rid="i", prompt="an innocent"))  # one crash only


async def test_requests_in_flight_at_a_planned_stop_are_not_quarantined(world):
    manager, broker, spawner = await world()
    slot = manager.slots["a"]
    for _ in range(3):
        conn = await manager.acquire(slot)
        await broker.submit(conn, p.GenerateRequest(rid="r", prompt="long"))
        await manager.unload(slot, "test")
    assert broker.registry.quarantine.quarantined() == []


async def test_an_unencodable_request_is_refused_before_it_is_registered(world):
    manager, broker, _ = await world()
    conn = await manager.acquire(manager.slots["a"])
    for bad in (
        p.GenerateRequest(rid="s", prompt="\ud800"),
        p.GenerateRequest(rid="n", prompt="x", max_tokens=2**64),
        p.GenerateRequest(rid="d", prompt="x", chat_template_kwargs=_nested(600)),
    ):
        with pytest.raises(ServiceError) as info:
            await broker.submit(conn, bad)
        assert info.value.code is ErrorCode.INVALID_REQUEST
    assert conn.load == 0 and broker.sent == []


def _nested(depth: int) -> dict:
    out: dict = {}
    for _ in range(depth):
        out = {"x": out}
    return out


async def test_two_requests_with_the_same_client_id_are_routed_apart(world):
    manager, broker, _ = await world()
    conn = await manager.acquire(manager.slots["a"])
    first = await broker.submit(conn, p.GenerateRequest(rid="same", prompt="one"), owner="alice")
    second = await broker.submit(conn, p.GenerateRequest(rid="same", prompt="two"), owner="bob")
    assert first.rid != second.rid and conn.load == 2
    broker._on_events(conn, [[second.rid, {"e": EventKind.FINISH, "reason": "stop", "text": "2"}]])
    assert (await second.next(1)).text == "2" and not first.done
    assert broker.find_stream("same", lambda s: s.owner == "alice") is first
    assert broker.find_stream("same", lambda s: s.owner == "carol") is None


async def test_the_broker_hands_each_request_typed_events_and_drops_unknown_kinds(world):
    manager, broker, _ = await world()
    conn = await manager.acquire(manager.slots["a"])
    stream = await broker.submit(conn, p.GenerateRequest(rid="typed", prompt="hi"))
    dropped = broker.dropped_messages
    delta, unknown = {"e": EventKind.DELTA, "text": "a", "n": 1}, {"e": "telepathy"}
    finish = {"e": EventKind.FINISH, "reason": "length", "usage": {"completion_tokens": 1}}
    broker._on_events(conn, [[stream.rid, delta], [stream.rid, unknown], [stream.rid, finish]])
    assert await stream.next(1) == Delta("a", 1)
    end = await stream.next(1)
    assert end == Finish(FinishReason.LENGTH, Usage(0, 1)) and stream.done and not stream.ready()
    assert broker.dropped_messages == dropped + 1


async def test_close_stops_every_worker_and_awaits_every_task(world):
    manager, _, spawner = await world(memory_budget="1GB")
    await asyncio.gather(*(manager.acquire(s) for s in manager.slots.values()))
    await manager.close()
    assert not spawner.alive and not manager._tasks
    assert all(s.state is SlotState.UNLOADED and s.restarts == 0 for s in manager.slots.values())


async def test_a_worker_lost_event_for_a_draining_slot_is_not_an_error(world):
    manager, broker, spawner = await world()
    spawner.drain_s = 0.1
    slot = manager.slots["a"]
    conn = await manager.acquire(slot)
    unloading = asyncio.create_task(manager.unload(slot, "test"))
    await until(lambda: slot.state is SlotState.DRAINING)
    manager.on_worker_event(WorkerLost(conn, "bye", ()))
    await unloading
    assert slot.last_error is None and slot.restarts == 0


async def test_a_context_length_above_the_models_own_is_reported(world):
    # the fake worker serves 64 tokens, as a worker capped at its model's own length would
    manager, _, _ = await world(models=[{"name": "a", "engine": "echo", "context_length": 128}])
    slot = manager.slots["a"]
    await manager.acquire(slot)
    assert "128" in slot.context_warning and "64" in slot.context_warning
    assert describe_slot(manager, slot)["context_warning"] == slot.context_warning
