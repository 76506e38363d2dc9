"""The family matrix under a small KV budget: a row paused mid-decode because the rows outgrew
the budget resumes from the prefix store with the tokens mlx-lm gives it alone, for every
family of tests/helpers/family_models.py (the matrix of tests/e2e/test_families.py).

The real Scheduler over the worker's real engine in-process (MLXRunner: BatchGenerator,
prefix cache, state checkpoints), with a KV budget of three of mlx-lm's 256-token row slots
(per layer kind, as worker/model/memory/kv_budget.py counts them) and a decode allowance of 16
tokens (the default 64 is tests/unit/test_kv_preemption.py's; a smaller one keeps the
matrix short). A long row (224 + 24 tokens: it may reach two slots) and a short one are
admitted together on what they hold; after 16 tokens the long row's next one needs a
second slot for both rows, so the short row (the later arrival) is paused, its KV published
to the store; it resumes once the long row ends. A family whose KV can be cut back resumes
from the store reading only its last token again; one with recurrent or sliding-window
layers (NON_TRIMMABLE) resumes from the deepest state checkpoint before its last token,
which for a row paused mid-decode is its prompt's end (the pause's own snapshot is at its
last token, one past what a resume may use), so it reads its generated tokens again. A
purely recurrent family (mamba2) holds the same bytes at any length: nothing outgrows the
budget there, and both rows run unpaused."""

from __future__ import annotations

import pytest
from helpers.family_models import FAMILIES, NON_TRIMMABLE, build_family_model
from helpers.greedy_parity import assert_greedy_equal, mlx_lm_greedy

from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.shared.protocol import GenerateRequest, SamplingParams
from mlxgw.worker.model.memory.kv_budget import KVBudget, Measured

NO_EOS = {0: -100.0, 2: -100.0}  # SmolLM2's end tokens: every row runs to its max_tokens
GREEDY = SamplingParams(temperature=0, logit_bias=NO_EOS)
ALLOWANCE = 16
LONG, LONG_ANSWER = 224, 24  # 224 + the allowance + 16 tokens of slack fill one slot exactly
SHORT, SHORT_ANSWER = 20, 30
PREFILL_BUDGET = 128


@pytest.fixture(scope="module")
def family_dirs(home, smollm2_dir):
    return {f: build_family_model(f, home / "models" / f"fam-{f}", smollm2_dir) for f in FAMILIES}


def _prompt(length: int, salt: int) -> list[int]:
    return [200 + (salt * 131 + i * 17) % 4000 for i in range(length)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_row_paused_for_kv_memory_resumes_from_the_store_with_mlx_lms_tokens(family, family_dirs):
    from mlxgw.worker.process.build_mlx import build_mlx_runner
    from mlxgw.worker.schedule.prefill_plan import PrefillPace
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner = build_mlx_runner(
        family_dirs[family],
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=PREFILL_BUDGET,
        cache_bytes=64 << 20,
        speculative=SpeculativeConfig(mode="off"),
    )
    profile = runner.kv_profile()
    kv = KVBudget(profile, Measured(0, "test"), decode_allowance=ALLOWANCE)
    pace = PrefillPace()
    pace.observe(1_000_000, 1.0)
    sched = Scheduler(runner, max_num_seqs=8, max_queue=8, prefill_budget=PREFILL_BUDGET, pace=pace, kv=kv)
    kv.measured = Measured(profile.rows_bytes([200] * 3, kv.chunk), "test")  # three slots, at the chunk it sets
    long_prompt, short_prompt = _prompt(LONG, 1), _prompt(SHORT, 2)
    for rid, prompt, answer in (("long", long_prompt, LONG_ANSWER), ("short", short_prompt, SHORT_ANSWER)):
        ((_, ev),) = sched.submit(GenerateRequest(rid=rid, prompt_tokens=prompt, max_tokens=answer, sampling=GREEDY))
        assert ev.KIND == "accepted" and ev.max_tokens == answer, ev
    short = sched._seqs["short"]  # the sequence keeps every token id it generated, across its pause
    ends, most = {}, 0
    for _ in range(1000):
        if not sched.has_work():
            break
        ends.update({rid: ev for rid, ev in sched.step() if ev.KIND in ("finish", "error")})
        most = max(most, sched.running)
    assert {rid: ev.KIND for rid, ev in ends.items()} == {"long": "finish", "short": "finish"}, ends
    assert most == 2, "both rows ran at once on what they hold"
    outgrows = profile.rows_bytes([LONG + LONG_ANSWER] * 2, kv.chunk) > kv.budget_bytes
    assert kv.preempted == (1 if outgrows else 0) and short.paused == kv.preempted, (family, profile.as_dict())
    if outgrows and family not in NON_TRIMMABLE:  # resumed from the store: its last token alone was read again
        assert sched.prefilled_tokens <= LONG + SHORT + 1, (family, sched.prefilled_tokens)
    elif outgrows:  # from the deepest state checkpoint before its last token (its prompt's end here)
        assert sched.prefilled_tokens <= LONG + SHORT + len(short.tokens), (family, sched.prefilled_tokens)
    reference = mlx_lm_greedy(runner.model, short_prompt, SHORT_ANSWER, NO_EOS)
    assert_greedy_equal(runner.model, short_prompt, reference, short.tokens, f"{family}, paused and resumed")
