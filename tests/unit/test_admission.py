"""Admission under load: a per-step prompt budget bounds how long decoding rows wait, and a
short prompt starts beside a long one instead of behind it (worker/schedule/prefill_plan.py).

The real Scheduler over the real MLXRunner (mlx-lm BatchGenerator) with the tiny model;
bounds are counted in prompt tokens read per step (what a step's time is made of), not in
seconds, so they hold on a loaded machine."""

from __future__ import annotations

import pytest

from mlxgw.shared.protocol import GenerateRequest, SamplingParams
from mlxgw.worker.schedule.prefill_plan import admit_count, chunk_for

BUDGET = 128
GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    # The folder as text, as bench/team/admission.py and bench/speculation/inprocess.py pass it
    # (a str once broke the KV-size probe, which globbed it as a Path).
    return build_mlx_runner(str(tiny_dir), context_length=None, max_num_seqs=8, prefill_step_size=BUDGET, cache_bytes=0)


def _scheduler(runner, budget: int | None = BUDGET):
    from mlxgw.worker.schedule.prefill_plan import PrefillPace
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    runner.set_prefill_chunk(BUDGET)  # as built: a test before may have left another chunk
    # A host whose prefill rate is measured and fast: admission alone decides (a fresh worker's
    # first step is bounded instead: tests/unit/test_prefill_pace.py).
    pace = PrefillPace()
    pace.observe(1_000_000, 1.0)
    return Scheduler(runner, max_num_seqs=8, max_queue=16, prefill_budget=budget, pace=pace)


def _submit(sched, rid: str, length: int, max_tokens: int) -> None:
    tokens = [100 + (hash(rid) + i) % 5000 for i in range(length)]
    req = GenerateRequest(rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=GREEDY)
    ((_, ev),) = sched.submit(req)
    assert ev.KIND == "accepted", ev


def _prompt_tokens_read(runner) -> int:
    return runner.generator._counters.prompt_tokens


# -- the plan, as a specification ---------------------------------------------------------
def test_short_prompts_arriving_together_start_together_within_the_budget():
    assert admit_count([], [80] * 10, 512) == 6  # 6 x 85-token chunks fit 512, a 7th would not


def test_a_short_prompt_starts_beside_a_long_one_that_is_prefilling():
    assert admit_count([3000], [80], 512) == 1
    assert chunk_for(2, 512) == 256  # the long one slows to 256 tokens a step; the short one finishes


def test_a_long_prompt_keeps_at_least_a_quarter_of_the_budget():
    assert admit_count([3000], [80] * 10, 512) == 3  # 4 rows x 128: a 5th would cut the long one below 128


def test_the_first_waiting_prompt_always_starts_when_nothing_is_prefilling():
    assert admit_count([], [100_000], 512) == 1


def test_a_prompt_served_whole_from_the_cache_takes_no_budget():
    assert admit_count([3000, 3000, 3000, 3000], [0, 0], 512) == 2


# -- the real scheduler and runner ---------------------------------------------------------
def test_long_prompts_arriving_while_rows_decode_read_at_most_the_budget_per_step(runner):
    sched = _scheduler(runner)
    for i in range(3):
        _submit(sched, f"running{i}", 8, 40)
    while sched.generated_tokens < 3:
        sched.step()
    for i in range(3):  # three long prompts at once: before, each read a full chunk per step
        _submit(sched, f"long{i}", 3 * BUDGET, 2)
    generated = sched.generated_tokens
    while any(r["id"].startswith("long") and r["ttft_s"] is None for r in sched.requests()):
        before = _prompt_tokens_read(runner)
        sched.step()
        read = _prompt_tokens_read(runner) - before
        assert read <= BUDGET, f"one step read {read} prompt tokens while rows were decoding"
    assert sched.generated_tokens > generated  # the running rows kept producing meanwhile
    while sched.has_work():
        sched.step()


def test_a_burst_at_an_idle_model_starts_a_budget_at_a_time_with_first_tokens_at_once(runner):
    """No row is decoding: a step may read IDLE_BUDGET_FACTOR budgets, but new prompts are
    admitted one budget at a time, and those read in a step have their first token at its
    end, so the first group of a burst decodes while the next is read (one larger step gave
    every prompt of the burst the last one's wait)."""
    from mlxgw.worker.schedule.prefill_plan import IDLE_BUDGET_FACTOR

    sched = _scheduler(runner)
    for i in range(12):
        _submit(sched, f"burst{i}", 60, 4)
    group = admit_count([], [59] * 12, BUDGET)
    assert group == 4  # 4 x 32-token shares of a 128 budget: a 5th would cut them below a quarter
    before = _prompt_tokens_read(runner)
    sched.step()
    assert _prompt_tokens_read(runner) - before <= IDLE_BUDGET_FACTOR * BUDGET
    assert sched.running == group
    decoding = {r["id"] for r in sched.requests() if r["ttft_s"] is not None}
    assert len(decoding) == group  # their whole prompts were read in this step
    sched.step()  # the next group starts reading while the first decodes
    assert sched.running == 2 * group
    sched.step()
    assert len({r["id"] for r in sched.requests() if r["ttft_s"] is not None}) >= 2 * group
    while sched.has_work():
        sched.step()


def test_without_a_budget_the_same_arrivals_read_several_chunks_in_one_step(runner):
    """The control for the test above: it can fail (this is what the budget prevents)."""
    sched = _scheduler(runner, budget=None)
    for i in range(3):
        _submit(sched, f"long{i}", 3 * BUDGET, 2)
    before = _prompt_tokens_read(runner)
    sched.step()
    assert _prompt_tokens_read(runner) - before == 3 * BUDGET
    while sched.has_work():
        sched.step()


def test_a_short_request_gets_its_first_token_before_a_long_prefill_completes(runner):
    sched = _scheduler(runner)
    _submit(sched, "long", 12 * BUDGET, 2)
    sched.step()  # the long prompt has started reading
    _submit(sched, "short", 16, 2)
    first: dict[str, int] = {}
    step = 0
    while len(first) < 2:
        step += 1
        ended = {rid for rid, ev in sched.step() if ev.KIND in ("finish", "error")}
        started = ended | {r["id"] for r in sched.requests() if r["ttft_s"] is not None}
        for rid in started - first.keys():
            first[rid] = step
    assert first["short"] < first["long"], first
    assert first["short"] <= 4  # admitted at once, not after the long prompt's 12+ steps
    while sched.has_work():
        sched.step()


# -- max_num_seqs when models.yaml leaves it out (worker/model/memory/capacity.py) ---------------------
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


def test_kv_bytes_per_token_is_layers_kv_heads_head_dim_keys_and_values_and_dtype():
    from mlxgw.worker.model.memory.capacity import kv_bytes_per_token

    assert kv_bytes_per_token(SMOLLM2, 4) == 30 * 3 * 64 * 2 * 4 == 46_080
    # no head_dim: hidden_size / attention heads; no kv heads: as many as attention heads
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 2) == 512
    # a vision model's text side
    assert kv_bytes_per_token({"text_config": SMOLLM2}, 2) == 23_040
    assert kv_bytes_per_token({"d_model": 384}, 4) is None


def test_max_num_seqs_is_the_kv_budget_over_a_typical_rows_kv_capped_and_never_raised():
    from mlxgw.worker.model.memory.capacity import default_max_num_seqs

    gib = 1 << 30
    # SmolLM2-135M float32 on 24 GiB: an eighth of RAM over 2,048 tokens x 45 KiB
    assert default_max_num_seqs(46_080, 24 * gib // 8, 2048) == 34
    assert default_max_num_seqs(46_080, 64 * gib // 8, 2048) == 64  # ceiling
    # A model of 0.5 MiB per token: 3 rows on 24 GiB, where a floor of 8 once admitted
    # 8 and four 3,000-token prompts killed the worker; memory decides, never a floor.
    assert default_max_num_seqs(32 * 16 * 128 * 2 * 4, 24 * gib // 8, 2048) == 3
    assert default_max_num_seqs(8 * 131_072, 16 * gib // 8, 2048) == 1  # a row's KV is the whole share
    assert default_max_num_seqs(8 * 131_072, 1 * gib // 8, 2048) == 1  # the least is one row


def test_a_configured_max_num_seqs_wins_over_the_formula(tiny_dir):
    from mlxgw.worker.model.memory.capacity import choose_max_num_seqs

    assert choose_max_num_seqs(3, tiny_dir, 1 << 40).value == 3
    chosen = choose_max_num_seqs(None, tiny_dir, 1 << 30)
    assert chosen.source == "kv formula" and chosen.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4


def test_the_admission_bench_runs_its_variants_on_a_real_runner(tiny_dir):
    """bench/team/admission.py drives the real Scheduler and, for comparison, mlx-lm's own
    BatchGenerator on the same model; both had gone unrun in CI once (a str folder broke the
    runner), so one burst and one closed loop of each run here, tiny and short."""
    from mlxgw.bench.loadgen import varied_prompts
    from mlxgw.bench.team.admission import VARIANTS, run_variant
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(str(tiny_dir), context_length=None, max_num_seqs=4, prefill_step_size=64, cache_bytes=0)
    prompts = varied_prompts(3, 12, seed=1)
    for name in ("budget+idle", "budget+idle (BLAS fixed)", "mlx-lm's BatchGenerator"):
        for clients in (3, 2):  # a burst, then a closed loop of 2 clients over 3 requests
            row = run_variant(runner, VARIANTS[name], prompts, clients, 4)
            assert row["requests"] == 3 and row["failed"] == 0, (name, row)
            assert row["tok_s"] > 0 and row["ttft_p50_s"] is not None, (name, row)
