"""A request that ends early leaves its KV in the prefix cache, so a retry resumes.

Agent clients on slow hosts give up on long prefills and resend the same prompt; before,
only finished requests seeded the prefix cache and every retry started from zero."""

from __future__ import annotations

import time

import pytest
from helpers import NO_EOS, openai_client
from helpers.gateway import GatewayProcess

from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row

STEP = 32  # prefill chunk: small, so a few steps leave a prefill half done


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=4, prefill_step_size=STEP, cache_bytes=64 << 20)


def _prompt(runner, words: int, salt: str) -> list[int]:
    return runner.encode_text(" ".join(f"{salt}{i % 97}" for i in range(words)))


def test_a_prefill_cut_after_some_chunks_is_resumed_from_those_chunks(runner):
    prompt = _prompt(runner, 300, "cut")
    assert len(prompt) > 6 * STEP
    uid, cached = runner.insert(Row(prompt, 8, SamplingParams(temperature=0.0)))
    assert cached == 0
    for _ in range(4):
        runner.step()
    runner.remove([uid])  # the client gave up mid-prefill
    uid, cached = runner.insert(Row(prompt, 8, SamplingParams(temperature=0.0)))
    runner.remove([uid])
    assert 3 * STEP <= cached < len(prompt)


def test_a_sequence_removed_before_any_prefill_adds_nothing(runner):
    prompt = _prompt(runner, 200, "queued")
    before = len(runner.prefix_cache)
    uid, _ = runner.insert(Row(prompt, 8, SamplingParams(temperature=0.0)))
    runner.remove([uid])
    assert len(runner.prefix_cache) == before


def test_a_retry_after_a_stream_cut_at_its_first_token_reuses_the_whole_prompt(tiny_gateway):
    client = openai_client(tiny_gateway)
    content = " ".join(f"retry{i}" for i in range(400))
    messages = [{"role": "user", "content": content}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, stream=True, extra_body={"logit_bias": NO_EOS}
    )
    for chunk in stream:  # the first chunk is the role preamble, sent before the prefill
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the client disconnects: the gateway cancels the request in the worker
    _wait_until_idle(tiny_gateway, "tiny")
    retry = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    prompt_tokens = retry.usage.prompt_tokens
    assert retry.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 1


def test_a_stream_cut_after_a_cache_hit_is_logged_with_its_cached_tokens(tiny_gateway):
    """The access log (and the ledger) of a stream that never got its finish event still
    counts the prompt tokens the prefix cache served: the worker sends them with the first
    delta (here the retry Claude Code sends after a timeout: 5,779 of 5,780 cached)."""
    client = openai_client(tiny_gateway)
    messages = [{"role": "user", "content": " ".join(f"logged{i}" for i in range(300))}]
    seeded = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    rid = "req_cut_after_cache_hit"
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=200,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
        extra_headers={"x-request-id": rid},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    _wait_until_idle(tiny_gateway, "tiny")
    deadline = time.monotonic() + 10
    while not (lines := [ln for ln in tiny_gateway.log().splitlines() if f"request_id={rid} " in ln]):
        assert time.monotonic() < deadline, "no access log line for the cut stream"
        time.sleep(0.1)
    assert "outcome=cancelled" in lines[0]
    assert f"cached_tokens={seeded.usage.prompt_tokens - 1}" in lines[0], lines[0]


def _wait_until_idle(gw: GatewayProcess, model: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = [w.get("stats") or {} for w in gw.model_status(model)["workers"]]
        if not any(s.get("running") or s.get("waiting") for s in stats):
            return
        time.sleep(0.1)
    raise AssertionError(f"{model} still busy after {timeout} s")


def test_cached_kv_holds_only_the_memory_it_counts(runner):
    """Eight sequences of different lengths finish at different steps of one batch; what the
    prefix cache then keeps alive is what it reports (the batch's buffers are freed)."""
    import gc

    import mlx.core as mx

    runner.cache_clear()
    gc.collect()
    baseline = mx.get_active_memory()
    for i in range(8):
        runner.insert(Row(_prompt(runner, 60 + 30 * i, f"mem{i}-"), 4 + 5 * i, SamplingParams(temperature=0.0)))
    while runner.generator.prompt_cache_nbytes or runner._rows:
        runner.step()
    gc.collect()
    held = mx.get_active_memory() - baseline
    assert len(runner.prefix_cache) >= 1
    assert held <= runner.prefix_cache.nbytes * 1.25 + (1 << 20), (held, runner.prefix_cache.nbytes)
    runner.cache_clear()
    gc.collect()
    assert mx.get_active_memory() - baseline <= 1 << 20
