"""Time limits end the answer, not the request.

Claude Code and the openai-agents SDK got 504s after hundreds of seconds with tokens already
generated. Now the answer's time bound finishes the answer with what was generated
(finish reason "length", marked time_limited, counted in usage), and the queue + prefill
bound grows with the prompt on a host that reads prompts slowly. The real Scheduler over the
real MLXRunner (tiny model); the API shapes are checked end to end in test_timeouts.py."""

from __future__ import annotations

import time

import pytest
from helpers.slow_host import SECONDS_PER_TOKEN, SlowHost

from mlxgw.gateway.pipeline.translate import RATE_CAP_FLOOR, rate_cap
from mlxgw.shared.protocol import GenerateRequest, SamplingParams

NO_EOS = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=4, prefill_step_size=128, cache_bytes=0)


def _run(sched, req: GenerateRequest, limit_s: float = 60) -> list:
    events = [ev for _, ev in sched.submit(req)]
    deadline = time.monotonic() + limit_s
    while sched.has_work() and time.monotonic() < deadline:
        events += [ev for rid, ev in sched.step() if rid == req.rid]
    assert not sched.has_work()
    return events


def test_the_answer_time_limit_finishes_with_the_tokens_generated(runner):
    from mlxgw.worker.schedule.scheduler import Scheduler

    sched = Scheduler(runner, max_num_seqs=4, max_queue=8)
    req = GenerateRequest(rid="slow-answer", prompt="Once upon a time", max_tokens=100000, sampling=NO_EOS, timeout_s=1)
    events = _run(sched, req)
    end = events[-1]
    assert end.KIND == "finish", end
    assert end.reason == "length" and end.time_limited is True
    generated = end.usage.completion_tokens
    assert generated > 0
    text = "".join(getattr(ev, "text", None) or "" for ev in events)
    assert text  # the answer so far reached the client


def test_the_prefill_bound_grows_with_the_prompt_on_a_slow_host(runner):
    """2,000 prompt tokens at 500 tokens/s take 4 s: past the 1-s floor, within twice the
    measured need; before, the request ended in a 504 with nothing."""
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    sched = Scheduler(SlowHost(runner), max_num_seqs=4, max_queue=8, prefill_budget=128)
    tokens = [100 + i % 5000 for i in range(2000)]
    req = GenerateRequest(
        rid="long-prompt", prompt_tokens=tokens, max_tokens=2, sampling=NO_EOS, timeout_s=60, prefill_timeout_s=1
    )
    started = time.monotonic()
    end = _run(sched, req)[-1]
    assert time.monotonic() - started > 2000 * SECONDS_PER_TOKEN
    assert end.KIND == "finish" and end.reason == "length", end
    assert end.usage.completion_tokens == 2


def test_the_prefill_bound_is_the_floor_or_twice_what_the_measured_rate_needs():
    """The scaling follows the prompt, not the wait: a short prompt keeps the floor."""
    from mlxgw.worker.schedule.prefill_plan import PrefillPace, prefill_bound

    pace = PrefillPace()
    pace.observe(100, 1.0)  # 100 tokens/s
    assert prefill_bound(40, 2, pace.tokens_per_s) == 2  # the floor
    assert prefill_bound(1000, 2, pace.tokens_per_s) == 20  # twice the 10 s it needs
    assert prefill_bound(1000, 2, None) == 2  # nothing measured: the floor


def test_a_request_without_max_tokens_is_capped_by_the_decode_rate():
    assert rate_cap(None, 300) is None  # nothing measured yet: the usual default
    assert rate_cap(2.0, 300) == 540  # 2 tokens/s for 90% of 300 s
    assert rate_cap(0.1, 300) == RATE_CAP_FLOOR
