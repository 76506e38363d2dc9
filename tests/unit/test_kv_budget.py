"""Admission by memory (worker/model/memory/kv_budget.py): what a row reserves, per kind of layer cache,
is what mlx-lm's batch really holds; rows are admitted within the budget, wait when they do
not fit, and only a request that cannot fit alone is refused, with the numbers.

The reservation arithmetic is checked against real batches: tiny random models of several
families (tests/helpers/family_models.py) run rows of different lengths through the real
MLXRunner (mlx-lm's BatchGenerator), and the bytes the batch holds at every step must stay
within what its rows reserved (exactly equal where the layout is one padded rectangle).
The scheduler tests run the real Scheduler over the real runner with the tiny llama."""

from __future__ import annotations

import json

import pytest
from helpers.family_models import WIDE_HEADS, build_family_model

from mlxgw.shared.model_sections import CacheConfig
from mlxgw.shared.protocol import GenerateRequest, SamplingParams
from mlxgw.worker.model.interfaces import Row
from mlxgw.worker.model.memory.kv_budget import ALLOC_STEP, FIXED, GROWS, WINDOW, KVBudget, KVProfile, LayerKV, Measured

GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence
CHUNK = 32  # prefill chunk: several per prompt, as long prompts have
ROWS = ((40, 20), (10, 30), (70, 5))  # (prompt tokens, max_tokens): a ragged batch


# -- the arithmetic, as a specification ---------------------------------------------------
def test_full_attention_rows_take_the_longest_rows_length_in_steps_of_256():
    profile = KVProfile([LayerKV(GROWS, 1000)])
    # one padded rectangle: 3 rows x the longest reach (300 + slack, rounded to 512) x bytes
    assert profile.rows_bytes([300, 10, 10]) == 3 * 512 * 1000
    assert profile.rows_bytes([10]) == ALLOC_STEP * 1000
    assert profile.rows_bytes([]) == 0


def test_a_sliding_window_layer_holds_at_most_its_window_and_one_chunk():
    profile = KVProfile([LayerKV(WINDOW, 100, window=1024)])
    assert profile.rows_bytes([100_000], chunk=512) == 1536 * 100  # not 100k tokens
    assert profile.rows_bytes([100], chunk=512) == 256 * 100  # short rows: their own length


def test_recurrent_state_is_the_same_at_any_length():
    profile = KVProfile([LayerKV(FIXED, fixed_bytes=4096)])
    assert profile.rows_bytes([10, 100_000]) == 2 * 4096


def test_a_request_that_fits_alone_only_with_fewer_tokens_is_cut_under_clamp_and_refused_under_reject():
    budget = KVBudget(KVProfile([LayerKV(GROWS, 1024)]), Measured(1024 * 1024, "test"))
    assert budget.tokens_alone() == 1024 - 16  # the speculative slack stays free
    assert budget.check_alone(100, 500, "clamp") == 500
    assert budget.check_alone(100, 5000, "clamp") == 1024 - 16 - 100
    with pytest.raises(Exception) as refused:
        budget.check_alone(100, 5000, "reject")
    err = refused.value
    assert err.status == 400 and err.code.value == "context_length_exceeded"
    d = err.details
    assert (d["prompt_tokens"], d["max_tokens"], d["kv_budget_bytes"]) == (100, 5000, 1024 * 1024)
    assert d["kv_bytes_needed"] > d["kv_budget_bytes"] and d["context_length"] == 1008
    assert "MiB" in err.message and "100 prompt tokens" in err.message
    with pytest.raises(Exception) as too_long:  # the prompt alone does not fit: refused under any policy
        budget.check_alone(2000, 10, "clamp")
    assert too_long.value.param == "messages"


def test_the_budget_is_the_setting_else_the_least_of_ram_and_the_process_limits_room():
    import subprocess
    import sys

    from mlxgw.worker.model.memory.kv_budget import measure_budget

    assert measure_budget(300, 1 << 40).bytes == 300 << 20
    assert measure_budget(None, 8 << 30).source in ("RAM", "cgroup")
    code = (
        "from mlxgw.worker.model.memory.kv_budget import measure_budget as m; "
        "b = m(None, 1 << 40); print(b.source, b.bytes)"
    )
    limit = 3 << 30

    def limited() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=limited, check=True)
    source, measured = out.stdout.split()
    assert source == "RLIMIT_AS" and 0 < int(measured) < limit // 2, out.stdout  # half of what is left


# -- the arithmetic against real batches, per family -------------------------------------
FAMILY_KINDS = {
    "llama": {GROWS},
    "gemma3_text": {GROWS, WINDOW},  # sliding-window + global layers
    "qwen3_next": {GROWS, FIXED},  # gated DeltaNet + full attention
    "mamba2": {FIXED},  # recurrent only
}


@pytest.fixture(scope="module")
def family_dirs(home, smollm2_dir):
    return {f: build_family_model(f, home / "models" / f"kv-budget-{f}", smollm2_dir) for f in FAMILY_KINDS}


def _runner(path, kv_bits=None):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        path,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=CHUNK,
        cache_bytes=0,
        cache=CacheConfig(kv_bits=kv_bits),
    )


def _peak_batch_bytes(runner, rows) -> int:
    """Run the rows together to their ends; the most bytes the batch's caches held."""
    for prompt_len, max_tokens in rows:
        runner.insert(Row([300 + i for i in range(prompt_len)], max_tokens, GREEDY))
    finished, peak = 0, 0
    while finished < len(rows):
        finished += sum(t.finish is not None for t in runner.step().tokens)
        peak = max(peak, runner.generator.prompt_cache_nbytes)
    return peak


@pytest.mark.parametrize("family", list(FAMILY_KINDS))
def test_a_batch_never_holds_more_than_its_rows_reserved(family, family_dirs):
    runner = _runner(family_dirs[family])
    profile = runner.kv_profile()
    assert {layer.kind for layer in profile.layers} == FAMILY_KINDS[family]
    reserved = profile.rows_bytes([p + m for p, m in ROWS], chunk=4 * CHUNK)
    peak = _peak_batch_bytes(runner, ROWS)
    assert 0 < peak <= reserved, (family, peak, reserved)
    if WINDOW not in FAMILY_KINDS[family]:  # one padded rectangle (or constant state): exact
        assert peak == reserved, (family, peak, reserved)


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_quantized_kv_reserves_its_real_bytes(kv_bits, home, smollm2_dir):
    from tiny_model import build_tiny_model

    from mlxgw.worker.model.memory.capacity import kv_bytes_per_token

    path = build_tiny_model(home / "models" / "kv-wide", smollm2_dir, overrides=WIDE_HEADS)
    runner = _runner(path, kv_bits)
    profile = runner.kv_profile()
    config = json.loads((path / "config.json").read_text())
    # measured from the cache = the formula's quantized size (bits/8 + a scale and bias per group)
    assert profile.bytes_per_token() == kv_bytes_per_token(config, 4, kv_bits)
    reserved = profile.rows_bytes([p + m for p, m in ROWS[:2]])
    assert _peak_batch_bytes(runner, ROWS[:2]) == reserved


# -- the scheduler within a budget ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=8, prefill_step_size=128, cache_bytes=64 << 20
    )


def _scheduler(runner, rows_that_fit: int, reach: int = 200):
    """A scheduler whose KV budget holds rows_that_fit rows of `reach` tokens."""
    from mlxgw.worker.schedule.prefill_plan import PrefillPace
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    profile = runner.kv_profile()
    budget = KVBudget(profile, Measured(profile.rows_bytes([reach] * rows_that_fit), "test"))
    pace = PrefillPace()
    pace.observe(1_000_000, 1.0)
    sched = Scheduler(runner, max_num_seqs=8, max_queue=16, prefill_budget=128, pace=pace, kv=budget)
    return sched, budget


def _request(rid: str, length: int, max_tokens: int, policy: str = "clamp") -> GenerateRequest:
    tokens = [100 + (sum(map(ord, rid)) * 7 + i) % 5000 for i in range(length)]
    return GenerateRequest(
        rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=GREEDY, max_tokens_policy=policy
    )


def _run_to_end(sched) -> tuple[dict[str, dict], int]:
    """Step until nothing is left; each request's last event, and the most rows that ran."""
    last: dict[str, dict] = {}
    most = 0
    for _ in range(2000):
        if not sched.has_work():
            break
        for rid, ev in sched.step():
            last[rid] = ev
        most = max(most, sched.running)
        kv = sched.counters()["kv"]
        assert kv["reserved_bytes"] <= kv["budget_bytes"], kv
    return last, most


def test_rows_beyond_the_budget_wait_and_every_one_finishes(tiny_runner):
    sched, budget = _scheduler(tiny_runner, rows_that_fit=2)
    for i in range(5):
        ((_, ev),) = sched.submit(_request(f"r{i}", 150, 40))
        assert ev.KIND == "accepted", ev
    last, most = _run_to_end(sched)
    assert most == 2  # memory held two rows at a time (max_num_seqs is 8)
    assert sorted(last) == [f"r{i}" for i in range(5)]
    assert all(ev.KIND == "finish" for ev in last.values()), last
    assert not budget.waiting_for_memory and budget.refused == 0


def test_a_request_too_big_to_fit_alone_is_refused_with_the_numbers_and_others_run(tiny_runner):
    sched, budget = _scheduler(tiny_runner, rows_that_fit=1, reach=200)
    alone = budget.tokens_alone()
    ((_, refused),) = sched.submit(_request("huge", alone + 10, 8))
    assert refused.KIND == "error" and refused.error.code == "context_length_exceeded", refused
    details = refused.error.details
    assert details["prompt_tokens"] == alone + 10 and details["kv_budget_bytes"] == budget.budget_bytes
    ((_, accepted),) = sched.submit(_request("asks-too-much", 100, 10_000))  # clamp: cut to fit
    assert accepted.KIND == "accepted" and accepted.max_tokens == alone - 100
    ((_, rejected),) = sched.submit(_request("rejects", 100, 10_000, policy="reject"))
    assert rejected.KIND == "error" and rejected.error.param == "max_tokens"
    sched.cancel("asks-too-much")
    ((_, ok),) = sched.submit(_request("fits", 100, 8))
    last, _ = _run_to_end(sched)
    assert last["fits"].KIND == "finish"
    assert budget.refused == 2 and budget.clamped == 1


def test_the_prefix_cache_is_evicted_to_make_room_for_a_row(tiny_runner):
    sched, budget = _scheduler(tiny_runner, rows_that_fit=2, reach=600)
    for i in range(6):  # finished rows' KV fills the prefix cache
        sched.submit(_request(f"fill{i}", 500, 4))
    _run_to_end(sched)
    assert tiny_runner.prefix_cache.nbytes > 0
    sched.submit(_request("a", 500, 90))
    sched.submit(_request("b", 500, 90))
    for _ in range(20):  # both admitted (a prompt budget at a time): the cache keeps what they leave
        sched.step()
        kv = sched.counters()["kv"]
        if kv["rows"] == 2:
            break
    assert kv["rows"] == 2 and kv["reserved_bytes"] <= kv["budget_bytes"]
    assert tiny_runner.prefix_cache.nbytes <= kv["budget_bytes"] - kv["reserved_bytes"]
    assert kv["prefix_cache_bytes"] == tiny_runner.prefix_cache.nbytes
    last, _ = _run_to_end(sched)
    assert last["a"].KIND == last["b"].KIND == "finish"


def test_a_cut_to_make_room_keeps_the_prefix_the_admitted_row_reuses(tiny_runner):
    sched, budget = _scheduler(tiny_runner, rows_that_fit=1, reach=700)
    first = _request("turn1", 500, 4)
    sched.submit(first)
    _run_to_end(sched)
    assert tiny_runner.prefix_cache.nbytes > 0
    # The next turn: the same prompt and more; alone it leaves the cache no room at all.
    follow = GenerateRequest(
        rid="turn2", prompt_tokens=first.prompt_tokens + list(range(700, 760)), max_tokens=100, sampling=GREEDY
    )
    sched.submit(follow)
    sched.step()
    (row,) = [r for r in sched.requests() if r["id"] == "turn2"]
    assert row["cached_tokens"] >= 500, row  # looked up before the cut
    kv = sched.counters()["kv"]
    assert tiny_runner.prefix_cache.nbytes <= kv["budget_bytes"] - kv["reserved_bytes"]
    _run_to_end(sched)


def test_a_draft_models_kv_is_reserved_with_the_targets(tiny_dir):
    from helpers.runner_jobs import speculative_runner

    from mlxgw.shared.model_sections import SpeculativeConfig

    plain = speculative_runner(tiny_dir, SpeculativeConfig(mode="off")).kv_profile()
    drafted = speculative_runner(tiny_dir, SpeculativeConfig(mode="draft", draft_model=str(tiny_dir))).kv_profile()
    assert drafted.bytes_per_token() == 2 * plain.bytes_per_token()  # the model is its own draft
