"""Optimistic admission by KV memory and preemption to the prefix store (worker/schedule/kv_rows.py).

A row that can be paused reserves what it holds plus a decode allowance, not its whole
max_tokens; when the rows grow past the budget the latest arrival is paused, its KV goes to
the prefix cache, and it resumes from there with the next token. The scheduler tests run
the real Scheduler over the real MLXRunner (mlx-lm's BatchGenerator) with the tiny llama."""

from __future__ import annotations

import pytest

from mlxgw.shared.protocol import BACKGROUND_PRIORITY, GenerateRequest, SamplingParams
from mlxgw.worker.model.memory.kv_budget import DECODE_ALLOWANCE, KVBudget, Measured
from mlxgw.worker.schedule.kv_rows import after_step, reserve, victim
from mlxgw.worker.schedule.sequence import Sequence

GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence
PROMPT, ANSWER = 170, 100  # a reach of 270 tokens: 512 of mlx-lm's slots; 170 + the allowance: 256


def _seq(rid: str, prompt: int, max_tokens: int, arrival: int = 0, priority: int = 0, **req) -> Sequence:
    request = GenerateRequest(rid=rid, prompt_tokens=[5] * prompt, max_tokens=max_tokens, priority=priority, **req)
    return Sequence(request, [5] * prompt, max_tokens, 0.0, None, None, None, arrival=arrival)


# -- the policy, as a specification --------------------------------------------------------
def test_a_pausable_row_reserves_what_it_holds_plus_an_allowance_not_its_max_tokens():
    agent = _seq("agent", 1000, 32000)
    assert reserve(agent, pausable=True) == 1000 + DECODE_ALLOWANCE
    agent.tokens = [7] * 500
    assert reserve(agent, pausable=True) == 1500 + DECODE_ALLOWANCE and after_step(agent) == 1501
    short = _seq("short", 1000, 10)  # never more than its reach
    assert reserve(short, pausable=True) == after_step(short) + 9 == 1010
    assert reserve(agent, pausable=False) == 33000  # a row that cannot be paused counts all it may reach


def test_the_row_paused_for_memory_is_the_latest_arrival_of_the_least_urgent_class():
    first, second, third = (_seq(r, 10, 10, arrival=i) for i, r in enumerate(("first", "second", "third")))
    background = _seq("batch", 10, 10, arrival=0, priority=BACKGROUND_PRIORITY)
    assert victim([(first, True), (second, True), (third, False)]) is second  # third cannot be paused
    assert victim([(background, True), (first, True), (second, True)]) is background
    assert victim([(first, False)]) is None


# -- the real scheduler and runner ---------------------------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=8, prefill_step_size=128, cache_bytes=64 << 20
    )


def _scheduler(runner, slots: int | None):
    """A scheduler whose KV budget holds `slots` of mlx-lm's 256-token row slots (None: no budget)."""
    from mlxgw.worker.schedule.prefill_plan import PrefillPace
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    profile = runner.kv_profile()
    kv = None if slots is None else KVBudget(profile, Measured(profile.rows_bytes([200] * slots), "test"))
    pace = PrefillPace()
    pace.observe(1_000_000, 1.0)
    return Scheduler(runner, max_num_seqs=8, max_queue=16, prefill_budget=128, pace=pace, kv=kv)


def _request(rid: str) -> GenerateRequest:
    tokens = [100 + (sum(map(ord, rid)) * 7 + i) % 5000 for i in range(PROMPT)]
    return GenerateRequest(rid=rid, prompt_tokens=tokens, max_tokens=ANSWER, sampling=GREEDY)


def _run(sched, rids: list[str]) -> tuple[dict[str, str], dict[str, object], int]:
    """Submit and step to the end: each request's text, its last event, the most rows at once."""
    for rid in rids:
        ((_, ev),) = sched.submit(_request(rid))
        assert ev.KIND == "accepted", ev
    texts: dict[str, str] = {}
    last: dict[str, object] = {}
    most = 0
    for _ in range(3000):
        if not sched.has_work():
            break
        for rid, ev in sched.step():
            texts[rid] = texts.get(rid, "") + (getattr(ev, "text", None) or "")
            last[rid] = ev
        most = max(most, sched.running)
        kv = sched.admission.kv
        if kv is not None:  # the batch's real KV and the prefix cache stay within the budget at every step
            batch, cache = sched.runner.generator.prompt_cache_nbytes, sched.runner.prefix_cache.nbytes
            assert batch + cache <= kv.budget_bytes, (batch, cache, kv.budget_bytes)
    return texts, last, most


def test_rows_with_large_max_tokens_run_together_and_the_latest_is_paused_to_the_store_when_they_outgrow_it(
    runner,
):
    """Three slots: two rows of 170 + 100 tokens (each may reach 512 slots) are admitted
    together on what they hold; at ~70 tokens each they need 2 x 512 slots, so the second is
    paused to the prefix cache, resumes from it once the first ends, and says what it says alone."""
    sched = _scheduler(runner, slots=3)
    texts, last, most = _run(sched, ["first", "second"])
    assert most == 2, "both rows ran at once (reserving max_tokens ran one at a time)"
    kv = sched.counters()["kv"]
    assert kv["preempted"] == 1 and kv["refused"] == 0, kv
    assert all(ev.KIND == "finish" and ev.usage.completion_tokens == ANSWER for ev in last.values()), last
    # The paused row came back from the cache: only its two prompts (and at most a block) were computed.
    assert sched.prefilled_tokens <= 2 * PROMPT + 32, sched.prefilled_tokens
    alone, _, _ = _run(_scheduler(runner, slots=None), ["second"])
    assert texts["second"] == alone["second"], "the paused row's output must continue exactly"
