"""Fair share between API keys in a worker: admission by tenant, preemption of a
row held beyond its tenant's share without lost or duplicated output, background work
behind interactive requests, and granted priorities; in-process over the null runner, then
through real `mlxgw up` workers with real keys."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import yaml
from helpers import NO_EOS, http, start_gateway

from mlxgw.gateway.access.keys import hash_key
from mlxgw.shared import protocol as p
from mlxgw.shared.events import EventKind
from mlxgw.worker.model.runners.null_runner import NullRunner
from mlxgw.worker.schedule.fair_share import FairQueue
from mlxgw.worker.schedule.scheduler import Scheduler


def _run(sched: Scheduler, limit: int = 10_000) -> tuple[dict[str, str], dict[str, dict], list[str]]:
    """Step until idle: each request's streamed text, its end event, and the order of first tokens."""
    texts: dict[str, str] = {}
    ends: dict[str, dict] = {}
    first: list[str] = []
    for _ in range(limit):
        if not sched.has_work():
            break
        _collect(sched.step(), texts, ends, first)
    return texts, ends, first


def _collect(events, texts: dict, ends: dict, first: list) -> None:
    for rid, ev in events:
        if ev.KIND in (EventKind.DELTA, EventKind.FINISH):
            if ev.text and rid not in first:
                first.append(rid)
            texts[rid] = texts.get(rid, "") + (ev.text or "")
        if ev.KIND in (EventKind.FINISH, EventKind.ERROR):
            assert rid not in ends, f"{rid} ended twice"
            ends[rid] = ev


def _req(rid: str, tenant: str, max_tokens: int = 40, priority: int = 0) -> p.GenerateRequest:
    return p.GenerateRequest(rid=rid, prompt="some words here", max_tokens=max_tokens, tenant=tenant, priority=priority)


def _alone(req: p.GenerateRequest) -> str:
    sched = Scheduler(NullRunner(), max_num_seqs=4, max_queue=8)
    sched.submit(req)
    texts, _, _ = _run(sched)
    return texts[req.rid]


def test_a_late_key_preempts_a_flooding_key_and_nothing_is_lost_or_repeated():
    sched = Scheduler(NullRunner(), max_num_seqs=4, max_queue=64, fair=FairQueue(enabled=True, starve_s=0))
    for i in range(8):
        sched.submit(_req(f"a{i}", "A"))
    texts: dict[str, str] = {}
    ends: dict[str, dict] = {}
    first: list[str] = []
    for _ in range(3):
        _collect(sched.step(), texts, ends, first)
    sched.submit(_req("b0", "B"))
    rest_texts, rest_ends, rest_first = _run(sched)
    for rid, text in rest_texts.items():
        texts[rid] = texts.get(rid, "") + text
    ends.update(rest_ends)
    first += [r for r in rest_first if r not in first]
    assert sched.counters()["preemptions"] >= 1
    # B starts at once, ahead of A's queued four (a4..a7), though it came after them.
    assert first.index("b0") < min(first.index(f"a{i}") for i in range(4, 8))
    expected = _alone(_req("x", "A"))
    for rid in [f"a{i}" for i in range(8)] + ["b0"]:
        assert ends[rid].KIND == EventKind.FINISH and ends[rid].usage.completion_tokens == 40, rid
        assert texts[rid] == expected, f"{rid}: the paused row's output must continue exactly"


def test_one_key_alone_uses_every_row():
    sched = Scheduler(NullRunner(), max_num_seqs=4, max_queue=64, fair=FairQueue(enabled=True, starve_s=0))
    for i in range(6):
        sched.submit(_req(f"a{i}", "A"))
    sched.step()
    assert sched.running == 4 and sched.counters()["preemptions"] == 0


def test_weights_share_rows_in_proportion():
    sched = Scheduler(NullRunner(), max_num_seqs=4, max_queue=64)
    for i in range(6):
        sched.submit(p.GenerateRequest(rid=f"h{i}", prompt="w", max_tokens=50, tenant="H", weight=3))
        sched.submit(p.GenerateRequest(rid=f"l{i}", prompt="w", max_tokens=50, tenant="L", weight=1))
    sched.step()
    running = [r["id"][0] for r in sched.requests() if r["phase"] != "queued"]
    assert sorted(running) == ["h", "h", "h", "l"]


def _two_busy_rows_then(early: list[p.GenerateRequest], late: p.GenerateRequest):
    """Two rows busy with `early` (a long starvation bound), then `late` arrives: the
    scheduler and what the step after its arrival streamed (texts, ends, first tokens)."""
    sched = Scheduler(NullRunner(), max_num_seqs=2, max_queue=64, fair=FairQueue(enabled=True, starve_s=1000))
    for req in early:
        sched.submit(req)
    sched.step()
    sched.submit(late)
    texts: dict[str, str] = {}
    ends: dict[str, dict] = {}
    first: list[str] = []
    _collect(sched.step(), texts, ends, first)
    return sched, texts, ends, first


def test_background_rows_yield_to_an_interactive_request():
    # No starvation bound to wait out: background work yields at once.
    background = [_req(f"bg{i}", "A", priority=p.BACKGROUND_PRIORITY) for i in range(2)]
    sched, texts, ends, first = _two_busy_rows_then(background, _req("chat", "A", max_tokens=5))
    assert "chat" in first and sched.counters()["preemptions"] == 1, "the next step starts the interactive request"
    _, rest, _ = _run(sched)
    ends.update(rest)
    assert all(ends[r].usage.completion_tokens == 40 for r in ("bg0", "bg1"))


def test_a_key_with_no_row_running_preempts_at_once_and_one_with_a_row_waits_out_the_bound():
    # A long starvation bound: only a key with nothing running may skip it.
    flood = [_req(f"a{i}", "A") for i in range(4)]
    sched, texts, ends, first = _two_busy_rows_then(flood, _req("b0", "B", max_tokens=5))
    assert "b0" in first and sched.counters()["preemptions"] == 1, "B's first request starts on the next step"
    sched.submit(_req("b1", "B", max_tokens=5))  # B now holds a row: its second request waits its turn
    _collect(sched.step(), texts, ends, first)
    assert "b1" not in first and sched.counters()["preemptions"] == 1
    _, rest, _ = _run(sched)
    ends.update(rest)
    assert all(ends[f"a{i}"].usage.completion_tokens == 40 for i in range(4)), "nothing lost by the pause"


def test_fairness_off_is_first_come_first_served():
    sched = Scheduler(NullRunner(), max_num_seqs=4, max_queue=64, fair=FairQueue(enabled=False, starve_s=0))
    for i in range(8):
        sched.submit(_req(f"a{i}", "A"))
    sched.step()
    sched.submit(_req("b0", "B"))
    _, _, first = _run(sched)
    assert first[-1] == "b0" and sched.counters()["preemptions"] == 0


# -- through `mlxgw up`: real keys, real workers ---------------------------------------------
KEYS = {"alice": "mlxgw-fair-alice-0123456789", "bob": "mlxgw-fair-bob-0123456789", "ops": "mlxgw-fair-ops-012345"}
FAIR_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "tiny-fair", "source": "tiny", "preload": True, "max_num_seqs": 4, "max_queue": 64},
        {"name": "tiny-one", "source": "tiny", "preload": True, "max_num_seqs": 1, "max_queue": 8},
    ],
}


def test_prompt_reading_rows_are_shared_by_weight_and_a_key_alone_takes_them_all():
    from mlxgw.worker.schedule.fair_share import Row, Waiting

    def reading(tenant: str, weight: float = 1.0) -> Row:
        return Row(f"{tenant}-row", tenant, weight, 0, 0, True, prefilling=True)

    queue = FairQueue(enabled=True)
    a = Waiting(0, 10, "a-next", "A", 3.0)
    assert queue.may_start_prefill(a, [reading("A", 3.0)] * 5)  # nobody else has a prompt to read
    queue.push(Waiting(0, 11, "b-next", "B", 1.0))
    assert queue.may_start_prefill(a, [reading("A", 3.0)] * 2)  # 3 of 3 is within 3/4 of 3 rows
    assert not queue.may_start_prefill(a, [reading("A", 3.0)] * 3)  # 4 of 4 is not: B reads one
    b = Waiting(0, 11, "b-next", "B", 1.0)
    assert queue.may_start_prefill(b, [reading("A", 3.0)] * 3)  # each key may always read one
    batch = FairQueue(enabled=True)
    batch.push(Waiting(p.BACKGROUND_PRIORITY, 12, "c", "C"))  # background does not hold back interactive
    assert batch.may_start_prefill(a, [reading("A", 3.0)] * 4)
    assert FairQueue(enabled=False).may_start_prefill(a, [reading("B")] * 4)  # fairness off: FIFO


def _prefill_race(runner, fair: bool) -> list[str]:
    """Key B holds three decode rows; then key A sends four long prompts and B one, A's
    first. The real Scheduler over the real MLXRunner (tiny model), with a 128-token prompt
    budget: the order in which the five prompts get their first token."""
    from mlxgw.worker.schedule.prefill_plan import PrefillPace

    pace = PrefillPace()
    pace.observe(1_000_000, 1.0)  # a measured, fast host: the budget alone decides
    queue = FairQueue(enabled=fair, starve_s=60)  # no preemption: admission only
    sched = Scheduler(runner, max_num_seqs=16, max_queue=32, prefill_budget=128, pace=pace, fair=queue)
    greedy = p.SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence

    def submit(rid: str, tenant: str, length: int, max_tokens: int) -> None:
        tokens = [100 + (hash(rid) + i) % 5000 for i in range(length)]
        req = p.GenerateRequest(rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=greedy, tenant=tenant)
        ((_, ev),) = sched.submit(req)
        assert ev.KIND == "accepted", ev

    for i in range(3):
        submit(f"b-chat{i}", "B", 8, 400)
    for _ in range(3):
        sched.step()
    for i in range(4):
        submit(f"a{i}", "A", 600, 1)
    submit("b-long", "B", 600, 1)
    texts: dict[str, str] = {}
    ends: dict[str, dict] = {}
    first: list[str] = []
    for _ in range(200):
        _collect(sched.step(), texts, ends, first)
        if all(rid in ends for rid in ("a0", "a1", "a2", "a3", "b-long")):
            break
    for rid in ("a0", "a1", "a2", "a3", "b-long"):
        assert ends[rid].KIND == EventKind.FINISH and ends[rid].usage.completion_tokens == 1, rid
    for i in range(3):
        sched.cancel(f"b-chat{i}")  # frees their rows in the runner for the next race
    assert not sched.has_work()
    return [rid for rid in first if not rid.startswith("b-chat")]


def test_a_key_does_not_take_the_whole_prompt_budget_while_another_keys_prompt_waits(tiny_dir):
    """Key A holds fewer rows, so its four prompts come first in the row order; the prompt
    budget is shared apart from that: B's prompt is read beside A's first ones, not after
    all four (FIFO by rows: last)."""
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=16, prefill_step_size=128, cache_bytes=0)
    order = _prefill_race(runner, fair=True)
    assert order.index("b-long") <= 1, order  # read together with A's first
    assert _prefill_race(runner, fair=False)[-1] == "b-long"  # without tenants: behind all of A's


@pytest.fixture(scope="module")
def fair_gateway(home, tiny_dir):
    keys_path = home / "fair-keys.yaml"
    entries = [{"name": name, "sha256": hash_key(key), "admin": name == "ops"} for name, key in KEYS.items()]
    keys_path.write_text(yaml.safe_dump({"keys": entries}))
    gw = start_gateway(home, FAIR_CONFIG, "fair-gateway", extra_args=("--keys", str(keys_path)))
    yield gw
    gw.stop()


def _client(gw, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS[name], max_retries=0, timeout=120)


def _waiting(gw, model: str) -> int:
    status = http(f"{gw.url}/v1/status", headers={"Authorization": f"Bearer {KEYS['ops']}"})[2]
    workers = next(m for m in status["models"] if m["name"] == model)["workers"]
    return workers[0]["stats"].get("waiting", 0) if workers else 0


def test_a_second_key_is_served_before_most_of_a_flooding_keys_queue(fair_gateway):
    """The measurement behind fair share: key A starts 16 streams on a 4-row worker, key B
    sends one request once A's queue is waiting; B came after 13 of A's 16 with first come
    first served (after all 16 here with MLXGW_FAIR_SHARE=off). A's streams are long enough
    to outlast B on any host, and are closed once B is answered."""
    finished: list[str] = []
    lock = threading.Lock()
    b_done = threading.Event()

    def flood(i: int) -> None:
        stream = _client(fair_gateway, "alice").chat.completions.create(
            model="tiny-fair",
            messages=[{"role": "user", "content": f"story {i}"}],
            max_tokens=600,
            stream=True,
            extra_body={"logit_bias": NO_EOS},
        )
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    with lock:
                        finished.append(f"a{i}")
                if b_done.is_set():
                    return

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: _waiting(fair_gateway, "tiny-fair") >= 10, timeout=60)
        time.sleep(0.5)  # B comes after A's flood: A holds every row, 12 wait
        # One token: B's answer is complete with its first token (random weights may spend a
        # few tokens on pieces that print nothing, so a stream's first text is no clock).
        _client(fair_gateway, "bob").chat.completions.create(
            model="tiny-fair", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        with lock:
            done_before_b = len(finished)
    finally:
        b_done.set()
        for t in threads:
            t.join(120)
    assert done_before_b < 8, f"B's first token came after {done_before_b} of A's 16"


def test_a_key_asking_for_a_priority_it_was_not_granted_is_clamped(fair_gateway):
    """Both from one key (one tenant): the second asks priority -50 to jump the first, and is
    clamped to the key's min_priority (default 0), so it runs second."""
    order: list[str] = []
    blocker = _blocking_stream(fair_gateway, "alice")

    def send(name: str, priority: int) -> None:
        _client(fair_gateway, "alice").chat.completions.create(
            model="tiny-one",
            messages=[{"role": "user", "content": name}],
            max_tokens=2,
            extra_body={"priority": priority},
        )
        order.append(name)

    first = threading.Thread(target=send, args=("first", 0))
    first.start()
    _wait(lambda: _waiting(fair_gateway, "tiny-one") == 1)
    second = threading.Thread(target=send, args=("second", -50))
    second.start()
    _wait(lambda: _waiting(fair_gateway, "tiny-one") == 2)
    blocker.close()
    first.join(60)
    second.join(60)
    assert order == ["first", "second"]


def _blocking_stream(gw, key: str):
    """A stream holding tiny-one's only row until it is closed (its first chunk has come)."""
    stream = _client(gw, key).chat.completions.create(
        model="tiny-one",
        messages=[{"role": "user", "content": "block"}],
        max_tokens=30000,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
    )
    next(iter(stream))
    return stream


def _wait(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_service_tier_flex_runs_after_interactive_requests(fair_gateway):
    """A flex request queued first still runs after an interactive one queued later."""
    order: list[str] = []
    blocker = _blocking_stream(fair_gateway, "bob")

    def send(name: str, tier: str | None) -> None:
        extra = {"service_tier": tier} if tier else {}
        _client(fair_gateway, "bob").chat.completions.create(
            model="tiny-one", messages=[{"role": "user", "content": name}], max_tokens=2, extra_body=extra
        )
        order.append(name)

    flex = threading.Thread(target=send, args=("flex", "flex"))
    flex.start()
    _wait(lambda: _waiting(fair_gateway, "tiny-one") == 1)
    chat = threading.Thread(target=send, args=("chat", None))
    chat.start()
    _wait(lambda: _waiting(fair_gateway, "tiny-one") == 2)
    blocker.close()
    flex.join(60)
    chat.join(60)
    assert order == ["chat", "flex"]
    with pytest.raises(openai.BadRequestError) as refused:
        _client(fair_gateway, "bob").chat.completions.create(
            model="tiny-one", messages=[{"role": "user", "content": "x"}], max_tokens=2, service_tier="bogus"
        )
    assert "service_tier" in str(refused.value)


def test_weight_and_min_priority_are_checked_key_fields(tmp_path):
    from mlxgw.gateway.access.key_admin import KeyEditError, create_key, update_key
    from mlxgw.gateway.access.keys import KeyStore

    path = tmp_path / "keys.yaml"
    _, entry = create_key(path, "oncall", {"weight": 2, "min_priority": -20})
    assert (entry["weight"], entry["min_priority"]) == (2.0, -20)
    assert update_key(path, "oncall", {"weight": None})["weight"] == 1.0  # null: back to the default
    for bad in ({"weight": 0}, {"weight": "heavy"}, {"min_priority": -101}, {"min_priority": 1.5}):
        with pytest.raises(KeyEditError):
            update_key(path, "oncall", bad)
    store = KeyStore(path)
    store.refresh()
    (key,) = store.keys
    assert key.granted_priority(-100) == -20 and key.granted_priority(5) == 5
    assert len(key.tenant) == 16 and "oncall" not in key.tenant and key.sha256 not in key.tenant
