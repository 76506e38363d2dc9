"""The prefix index fed by the workers (PREFIXES: worker/model/cache/prefix_events.py), over
three local replicas of the tiny model with a small prefix cache and no disk tier, and two of
the real default model: a session's turns stay on one replica (`cached_tokens` proves it) and
its replica reports holding the prefix; one key's flood spreads over all three; a replica that
evicted a session's prefix reports it, and the session's next turn is no longer routed there
by that prefix. Real `mlxgw up`, real workers, real HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import NO_EOS, http, start_gateway

SYSTEM = "You answer questions about the fleet's maintenance records briefly."
TINY = {
    "name": "tiny",
    "preload": True,
    "max_num_seqs": 4,
    # 1 MB of prefix cache (a few thousand of the tiny model's tokens) and no disk tier: what
    # leaves memory leaves for good
    "cache": {"prefix_memory_mb": 1, "prefix_disk_mb": 0},
    "routing": {"replicas": 3, "load_margin": 1},
}


@pytest.fixture(scope="module")
def pool(home, tiny_dir, smollm2_dir):
    models = [TINY]
    if (smollm2_dir / "config.json").is_file():  # the real default model, two replicas
        models.append({"name": "smol", "source": str(smollm2_dir), "preload": True, "routing": {"replicas": 2}})
    gw = start_gateway(home, {"manager": {"auto_discover": False}, "models": models}, "replica-events-gateway")
    gw.models = [m["name"] for m in models]
    for model in gw.models:
        wait_ready(gw, model, 3 if model == "tiny" else 2)
    yield gw
    gw.stop()


def wait_ready(gw, model: str, replicas: int) -> None:
    deadline = time.monotonic() + 120
    while len(routed(gw, model)) < replicas and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(routed(gw, model)) == replicas, gw.model_status(model)


def routed(gw, model: str = "tiny") -> dict[str, dict]:
    return {r["replica"]: r for r in gw.model_status(model)["replicas"] if r.get("state") == "ready"}


def turn(gw, messages: list[dict], model: str = "tiny", **extra) -> dict:
    body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": messages, **extra}
    status, _, answer = http(gw.url + "/v1/chat/completions", "POST", body)
    assert status == 200, answer
    return answer


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def opening(session: int) -> str:
    return f"Session {session}: " + " ".join(f"record {session}-{i} lists part {i * 7 + session}." for i in range(24))


def two_turns(gw, session: int, model: str = "tiny", **extra) -> tuple[dict, dict]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(session)}]
    first = turn(gw, messages, model, **extra)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    second = turn(gw, [*messages, {"role": "user", "content": "And the next record?"}], model, **extra)
    return first, second


def delta(after: dict, before: dict, field: str) -> dict[str, int]:
    return {name: r[field] - before[name][field] for name, r in after.items()}


def test_three_replicas_keep_each_session_and_report_what_they_hold(pool):
    before = routed(pool)
    for session in range(6):
        first, second = two_turns(pool, session)
        assert cached(second) >= first["usage"]["prompt_tokens"] - 32, (session, first["usage"], second["usage"])
    after = routed(pool)
    by_prefix = delta(after, before, "routed_by_prefix")
    homes = [name for name, n in by_prefix.items() if n]
    assert sum(by_prefix.values()) == 6 and len(homes) >= 2, after  # sessions spread, each kept on its replica
    deadline = time.monotonic() + 5  # reports go out at most every half second
    while not all(routed(pool)[n]["reported_held"] > 0 for n in homes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(routed(pool)[n]["reported_held"] > 0 and routed(pool)[n]["indexed_prefixes"] > 0 for n in homes)


def test_one_keys_flood_spreads_over_all_three(pool):
    before = routed(pool)
    messages = [{"role": "user", "content": opening(50) + " Summarise them all in detail."}]
    with ThreadPoolExecutor(12) as ex:
        flood = {"max_tokens": 16, "logit_bias": NO_EOS, "prompt_cache_key": "flood"}  # all of one key's session
        list(ex.map(lambda _: turn(pool, messages, **flood), range(12)))
    after = routed(pool)
    hows = ("prefix", "session", "load")
    total = {n: sum(delta(after, before, f"routed_by_{how}")[n] for how in hows) for n in after}
    assert sum(total.values()) == 12 and all(total.values()), after  # past the margin, to the least loaded
    assert sum(delta(after, before, "routed_by_load").values()) >= 2


def test_a_replica_that_evicted_a_sessions_prefix_is_not_routed_to_by_it(pool):
    key = {"prompt_cache_key": "evicted-session"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(900)}]
    before = routed(pool)
    first = turn(pool, messages, **key)
    start = routed(pool)
    (home,) = [n for n, moved in delta(start, before, "routed_by_session").items() if moved]
    # fill its 1 MB with other prompts of the same session id (so placed on the same replica)
    for i in range(3):
        filler = " ".join(f"filler {i} line {j} says nothing new." for j in range(260))
        turn(pool, [{"role": "user", "content": filler}], **key)
    time.sleep(1.0)  # the worker reports at most every half second: what it evicted has gone out
    deadline = time.monotonic() + 10
    while routed(pool)[home]["reported_evicted"] == start[home]["reported_evicted"] and time.monotonic() < deadline:
        time.sleep(0.2)
    mid = routed(pool)
    assert mid[home]["reported_evicted"] > start[home]["reported_evicted"], mid[home]
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    second = turn(pool, [*messages, {"role": "user", "content": "And the next record?"}], **key)
    after = routed(pool)
    # placed by its session id again, not by a prefix the replica no longer has
    assert sum(delta(after, mid, "routed_by_prefix").values()) == 0, after
    assert sum(delta(after, mid, "routed_by_session").values()) == 1, after
    assert cached(second) < 64, second["usage"]


def test_two_replicas_of_the_default_model_keep_each_session(pool, smollm2_dir):
    if "smol" not in pool.models:
        pytest.skip(f"the default model is not at {smollm2_dir}")
    before = routed(pool, "smol")
    for session in range(2):  # the real model reads each prompt for seconds on this CPU: two sessions
        first, second = two_turns(pool, session, "smol")
        assert cached(second) >= first["usage"]["prompt_tokens"] - 32, (session, first["usage"], second["usage"])
    after = routed(pool, "smol")
    assert sum(delta(after, before, "routed_by_prefix").values()) == 2, after
    deadline = time.monotonic() + 5
    while not any(r["reported_held"] for r in routed(pool, "smol").values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(r["reported_held"] > 0 for r in routed(pool, "smol").values()), routed(pool, "smol")
