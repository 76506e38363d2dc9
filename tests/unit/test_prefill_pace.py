"""A slow host reads prompts in smaller steps, so no engine step looks hung.

On the shared 2-core test host a Claude Code prompt (5,780 tokens) read in the idle burst's
2,048-token steps took over 120 s for one step, and the gateway's watchdog killed the worker
mid-prefill. The scheduler now measures how fast the host reads prompt tokens and caps a
step at what it reads in `max_step_s` (worker/schedule/prefill_plan.py). The real Scheduler over the
real MLXRunner (tiny model), slowed down as a slow host is: each prompt token read costs time."""

from __future__ import annotations

import pytest
from helpers.slow_host import SECONDS_PER_TOKEN, SlowHost

from mlxgw.shared.protocol import GenerateRequest, SamplingParams
from mlxgw.worker.schedule.prefill_plan import FIRST_STEP_BUDGET, MAX_PREFILL_STEP_S, MIN_PACED_BUDGET, PrefillPace

BUDGET = 128
GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=8, prefill_step_size=BUDGET, cache_bytes=0)


def _submit(sched, rid: str, length: int, max_tokens: int) -> None:
    tokens = [100 + (hash(rid) + i) % 5000 for i in range(length)]
    ((_, ev),) = sched.submit(GenerateRequest(rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=GREEDY))
    assert ev.KIND == "accepted", ev


def _read_a_long_prompt(runner, pace: PrefillPace) -> list[int]:
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    host = SlowHost(runner)
    sched = Scheduler(host, max_num_seqs=8, max_queue=16, prefill_budget=BUDGET, pace=pace)
    _submit(sched, "long", 12 * BUDGET, 2)
    while sched.has_work():
        sched.step()
    return [r for r in host.reads if r > 0]


def test_a_slow_host_reads_a_long_prompt_in_steps_that_fit_the_step_time(runner):
    max_step_s = 0.1  # at 500 tokens/s: at most 50 tokens a step
    reads = _read_a_long_prompt(runner, PrefillPace(max_step_s=max_step_s))
    cap = max(MIN_PACED_BUDGET, int(max_step_s / SECONDS_PER_TOKEN))
    assert reads[0] == FIRST_STEP_BUDGET  # the first step, unmeasured, is bounded from the start
    assert max(reads[1:]) <= cap, reads
    assert sum(reads) == 12 * BUDGET - 1


def test_a_fast_enough_host_keeps_the_idle_burst(runner):
    """The control: a step time the host meets leaves the budget as it was."""
    reads = _read_a_long_prompt(runner, PrefillPace(max_step_s=60))
    assert max(reads[1:]) > max(MIN_PACED_BUDGET, int(0.1 / SECONDS_PER_TOKEN))


def test_with_nothing_decoding_a_long_read_still_steps_within_half_a_second_by_default(runner):
    """A request that arrives during a long read waits for the step in progress: the default
    bound keeps it to half a second of this host's reading though the budget allows far more (at
    10 s, a 20-token chat sent 0.5 s after a 6,000-token prompt waited 16 s for its first token)."""
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    host = SlowHost(runner)
    sched = Scheduler(host, max_num_seqs=8, max_queue=16, prefill_budget=2048, pace=PrefillPace())
    _submit(sched, "long", 3000, 2)
    while sched.has_work():
        sched.step()
    reads = [r for r in host.reads if r > 0]
    bound = int(MAX_PREFILL_STEP_S / SECONDS_PER_TOKEN)  # 250 tokens on this host
    assert max(reads[1:]) <= 1.25 * bound < 2048, reads  # the budget alone: 4 x 2,048 a step
    assert sum(reads) == 2999


def test_while_a_row_decodes_a_prefill_step_keeps_to_the_shorter_bound(runner):
    """The decoding row's every token waits for the step: it gets the shorter bound."""
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    host = SlowHost(runner)
    pace = PrefillPace(max_step_s=1.0, max_step_decoding_s=0.1)
    sched = Scheduler(host, max_num_seqs=8, max_queue=16, prefill_budget=BUDGET, pace=pace)
    _submit(sched, "running", 8, 400)
    while sched.generated_tokens < 2:
        sched.step()
    _submit(sched, "long", 12 * BUDGET, 2)
    while any(r["id"] == "long" and r["ttft_s"] is None for r in sched.requests()):
        sched.step()
    cap = max(MIN_PACED_BUDGET, int(0.1 / SECONDS_PER_TOKEN))
    assert max(host.reads[-5:]) <= cap < BUDGET, host.reads  # 1 s alone would allow BUDGET
    sched.cancel("running")
    while sched.has_work():
        sched.step()


def test_the_pace_follows_a_slowdown_at_once_and_recovers_over_steps():
    pace = PrefillPace(max_step_s=10)
    assert pace.cap(8192) == FIRST_STEP_BUDGET  # nothing measured yet: a conservative first step
    pace.observe(2048, 1.0)
    assert pace.cap(8192) == 8192  # 20,480 tokens in 10 s
    pace.observe(100, 10.0)  # a stalled step: 10 tokens/s
    assert pace.cap(8192) == 100
    pace.observe(500, 1.0)
    assert pace.cap(8192) == 2550  # half way back to 500 tokens/s
    pace.observe(0, 5.0)  # a step that read no prompt says nothing about the pace
    assert pace.cap(8192) == 2550
    pace.observe(1, 1000.0)
    assert pace.cap(8192) == MIN_PACED_BUDGET


def test_the_step_bounds_follow_a_shorter_watchdog():
    assert PrefillPace.for_hang_timeout(120) == PrefillPace()
    short = PrefillPace.for_hang_timeout(6)
    assert short.max_step_s == 0.5 and short.max_step_decoding_s == 0.5


def test_rows_that_decode_get_the_shorter_step():
    pace = PrefillPace(max_step_s=10, max_step_decoding_s=2)
    pace.observe(100, 1.0)
    assert pace.cap(8192) == 1000 and pace.cap(8192, decoding=True) == 200


def test_the_decode_time_is_measured_in_every_step_not_only_in_steps_that_read_no_prompt():
    """Under load every step reads a prompt: a decode time inferred only from the steps that
    read none stayed at the first one-row step's, and held the budget at its floor."""
    timed, untimed = PrefillPace(), PrefillPace()
    for pace in (timed, untimed):
        pace.observe(0, 0.05)  # the first decode step, of one row
    for _ in range(40):  # 24 agents later: 0.25 s of decoding and 64 prompt tokens in 1 s, every step
        timed.observe(64, 1.25, prompt_s=1.0, decoding=True)
        untimed.observe(64, 1.25)
    assert timed.decode_s == pytest.approx(0.25, rel=0.05) and timed.tokens_per_s == 64
    assert timed.cap(512, decoding=True, decode_steps=4) in (63, 64)  # four decode steps: 1 s of reading
    assert untimed.cap(512, decoding=True, decode_steps=4) == MIN_PACED_BUDGET  # what it was


def test_a_step_that_decodes_nothing_says_nothing_of_the_decode_time():
    pace = PrefillPace()
    pace.observe(0, 0.2)
    pace.observe(512, 2.0, prompt_s=1.99, decoding=False)  # an idle burst: its 10 ms are first forwards
    assert pace.decode_s == 0.2 and round(pace.tokens_per_s) == 257
