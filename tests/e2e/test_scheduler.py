"""The worker engine: prefix cache, cancellation, priority, stream_interval, status."""

from __future__ import annotations

import threading

from helpers import cancel_request, http, openai_client, running, start_long_stream, wait_for


def story(n_words: int, seed: int = 0) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return " ".join(words[(i * 7 + seed) % len(words)] + str(i % 13) for i in range(n_words))


def worker_stats(gw, model: str) -> dict:
    workers = gw.model_status(model)["workers"]
    return workers[0]["stats"] if workers else {}


def test_prefix_cache_hit_gives_the_same_greedy_output(tiny_gateway):
    client = openai_client(tiny_gateway)
    http(f"{tiny_gateway.url}/v1/cache?model=tiny", "DELETE")
    messages = [{"role": "system", "content": story(300)}, {"role": "user", "content": "Go on."}]
    cold = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    warm = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # A follow-up turn re-sends the conversation: its whole shared prefix is reused.
    follow = messages + [
        {"role": "assistant", "content": cold.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    out = client.chat.completions.create(model="tiny", messages=follow, max_tokens=5, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens


def test_cache_stats_and_clear(tiny_gateway):
    client = openai_client(tiny_gateway)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": story(50, 3)}], max_tokens=4)
    status, _, stats = http(f"{tiny_gateway.url}/v1/cache/stats?model=tiny")
    (worker,) = stats["models"]["tiny"]
    assert status == 200 and worker["entries"] >= 1 and worker["bytes"] > 0
    assert 0 <= worker["hit_rate"] <= 1
    status, _, cleared = http(f"{tiny_gateway.url}/v1/cache?model=tiny", "DELETE")
    assert status == 200 and cleared["models"]["tiny"][0]["entries"] == 0
    assert cleared["models"]["tiny"][0]["bytes"] == 0


def test_cancellation_frees_the_sequence_and_its_kv(tiny_gateway):
    wait_for(lambda: running(tiny_gateway, "tiny") == 0)
    wait_for(lambda: "kv_bytes" in worker_stats(tiny_gateway, "tiny"))
    baseline = worker_stats(tiny_gateway, "tiny")["kv_bytes"]
    _stream = start_long_stream(tiny_gateway, "tiny", "kv-free-1", story(100))
    wait_for(lambda: worker_stats(tiny_gateway, "tiny")["kv_bytes"] > baseline)
    cancel_request(tiny_gateway, "kv-free-1")
    wait_for(lambda: running(tiny_gateway, "tiny") == 0, 10)
    try:
        # at most the baseline: KV of an earlier test's sequence may still have been live then
        wait_for(lambda: worker_stats(tiny_gateway, "tiny")["kv_bytes"] <= baseline, 10)
    except AssertionError:
        raise AssertionError(f"baseline {baseline}, now {worker_stats(tiny_gateway, 'tiny')}") from None


def test_prefix_cache_respects_its_byte_bound_under_churn(tiny_gateway):
    client = openai_client(tiny_gateway)
    bound = 1 << 20  # cache.prefix_memory_mb: 1
    for i in range(12):
        client.chat.completions.create(
            model="tiny-smallcache", max_tokens=4, messages=[{"role": "user", "content": story(250, i)}]
        )
        _, _, stats = http(f"{tiny_gateway.url}/v1/cache/stats?model=tiny-smallcache")
        worker = stats["models"]["tiny-smallcache"][0]
        assert worker["bytes"] <= bound
    assert worker["entries"] < 12


def test_priority_orders_waiting_requests(tiny_gateway):
    client = openai_client(tiny_gateway)
    order: list[str] = []
    _stream = start_long_stream(tiny_gateway, "tiny-serial", "blocker-1")

    def send(name: str, priority: int) -> None:
        client.chat.completions.create(
            model="tiny-serial",
            max_tokens=3,
            extra_body={"priority": priority},
            messages=[{"role": "user", "content": name}],
        )
        order.append(name)

    low = threading.Thread(target=send, args=("low", 10))
    low.start()
    wait_for(lambda: worker_stats(tiny_gateway, "tiny-serial").get("waiting") == 1)
    high = threading.Thread(target=send, args=("high", -5))
    high.start()
    wait_for(lambda: worker_stats(tiny_gateway, "tiny-serial").get("waiting") == 2)
    cancel_request(tiny_gateway, "blocker-1")
    low.join(60)
    high.join(60)
    assert order == ["high", "low"]


def test_stream_interval_groups_tokens_per_chunk(tiny_gateway):
    client = openai_client(tiny_gateway)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"stream_interval": 6},
        )
    )
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert 2 <= len(content_chunks) <= 5


def test_status_lists_requests_in_flight(tiny_gateway):
    _stream = start_long_stream(tiny_gateway, "tiny", "status-probe-1")

    def listed():
        reqs = worker_stats(tiny_gateway, "tiny")["requests"]
        # the worker knows the gateway's routing id: the client's x-request-id plus "#n"
        mine = (r for r in reqs if r["id"].partition("#")[0] == "status-probe-1")
        return next((r for r in mine if r["generated_tokens"] > 0), None)

    entry = wait_for(listed)
    assert entry["phase"] == "decode" and entry["ttft_s"] is not None
    stats = worker_stats(tiny_gateway, "tiny")
    assert {"running", "waiting", "tokens_per_s", "rss_bytes", "mlx_active_bytes", "cache"} <= set(stats)
    assert cancel_request(tiny_gateway, "status-probe-1") == 200


def test_new_request_is_admitted_while_another_decodes(tiny_gateway):
    client = openai_client(tiny_gateway)
    _stream = start_long_stream(tiny_gateway, "tiny", "admission-long-1")
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "short"}], max_tokens=4)
    assert out.usage.completion_tokens == 4
    assert cancel_request(tiny_gateway, "admission-long-1") == 200, "the long request should still be running"


def test_a_sequence_the_runner_refuses_at_admission_ends_alone():
    """In-process: the scheduler over the null runner, which here refuses one prompt when it
    is admitted (as a vision tower refuses images); the other sequences run on."""
    from mlxgw.shared import protocol as p
    from mlxgw.shared.errors import invalid
    from mlxgw.shared.events import EventKind
    from mlxgw.worker.model.runners.null_runner import NullRunner
    from mlxgw.worker.schedule.scheduler import Scheduler

    class RefusingRunner(NullRunner):
        def insert(self, row):
            if row.prompt == [6]:  # the prompt "refuse"
                raise invalid("the model could not encode the images", "messages")
            return super().insert(row)

    sched = Scheduler(RefusingRunner(), max_num_seqs=4, max_queue=8)
    for rid, text in (("a", "fine words"), ("b", "refuse"), ("c", "more fine words")):
        ((_, ev),) = sched.submit(p.GenerateRequest(rid=rid, prompt=text, max_tokens=3))
        assert ev.KIND == EventKind.ACCEPTED
    ends = {}
    while sched.has_work():
        for rid, ev in sched.step():
            if ev.KIND in (EventKind.FINISH, EventKind.ERROR):
                ends[rid] = ev
    assert ends["b"].KIND == EventKind.ERROR and ends["b"].error.code == "invalid_request"
    assert ends["a"].KIND == ends["c"].KIND == EventKind.FINISH and ends["a"].usage.completion_tokens == 3
