"""The engine step's order (worker/model/runners/batch_generator.py): a prompt's first token comes out in
the step that reads its last chunk, and the order changes no token.

The real MLXRunner on the tiny model; mlx-lm's own order (`reads_first = False`) is the
control each timing test compares with, so each test fails if the order is undone."""

from __future__ import annotations

import pytest

from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row

GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        tiny_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=64,
        cache_bytes=32 << 20,
        speculative=SpeculativeConfig(mode="off"),
    )


@pytest.fixture
def order(runner):
    """Sets the step order for one test; the runner is left in the engine's order after."""

    def use(reads_first: bool) -> None:
        runner.cache_clear()
        runner.generator.reads_first = reads_first

    yield use
    runner.generator.reads_first = True
    while runner.generator._generation_batch.uids or runner.generator._prompt_batch.uids:
        runner.step()


def _prompt(seed: int, length: int) -> list[int]:
    return [200 + (seed * 131 + i * 17) % 4000 for i in range(length)]


def _steps_to_first_token(runner, prompt: list[int]) -> int:
    uid, _ = runner.insert(Row(prompt, 3, GREEDY))
    for step in range(1, 20):
        if any(t.uid == uid for t in runner.step().tokens):
            return step
    raise AssertionError("no first token in 20 steps")


@pytest.mark.parametrize("reads_first", [True, False])
def test_a_prompt_read_in_one_chunk_has_its_first_token_in_that_step(runner, order, reads_first):
    order(reads_first)
    steps = _steps_to_first_token(runner, _prompt(1, 40))  # 40 tokens: one 64-token chunk
    assert steps == (1 if reads_first else 3)


@pytest.mark.parametrize("reads_first", [True, False])
def test_a_long_prompt_has_its_first_token_in_the_step_that_reads_its_last_chunk(runner, order, reads_first):
    order(reads_first)
    steps = _steps_to_first_token(runner, _prompt(2, 3 * 64 + 10))  # 202 tokens: four chunks
    assert steps == (4 if reads_first else 6)


def test_a_prompt_served_from_the_cache_starts_in_its_first_step(runner, order):
    order(True)
    prompt = _prompt(3, 90)
    _steps_to_first_token(runner, prompt)
    while runner.generator._generation_batch.uids:  # ends: its KV goes to the prefix cache
        runner.step()
    uid, cached = runner.insert(Row(prompt, 3, GREEDY))
    assert cached == len(prompt) - 1  # only the last token is left to read
    assert any(t.uid == uid for t in runner.step().tokens)


def test_a_first_token_does_not_wait_for_a_prompt_admitted_in_the_step_after(runner, order):
    """A group that finishes reading in step 1 has its first tokens at step 1, though the
    next group starts reading in step 2 (mlx-lm's order gave them out after that read)."""
    order(True)
    first = [runner.insert(Row(_prompt(10 + i, 30), 4, GREEDY))[0] for i in range(3)]
    out = runner.step()
    assert {t.uid for t in out.tokens} == set(first)
    second = [runner.insert(Row(_prompt(20 + i, 30), 4, GREEDY))[0] for i in range(3)]
    out = runner.step()
    assert {t.uid for t in out.tokens} == set(first) | set(second)


def test_the_order_changes_no_token_for_rows_arriving_while_others_decode(runner, order):
    """Rows of different lengths arrive at different steps, one from the prefix cache; greedy
    tokens are the same in either order."""
    arrivals = {0: [_prompt(30, 150), _prompt(31, 20)], 2: [_prompt(32, 70)], 5: [_prompt(30, 150)]}

    def run(reads_first: bool) -> list[list[int]]:
        order(reads_first)
        out: dict[int, list[int]] = {}
        slots: dict[int, int] = {}
        step = finished = 0
        while finished < 4:
            for prompt in arrivals.get(step, []):
                uid, _ = runner.insert(Row(prompt, 12, GREEDY))
                slots[uid] = len(slots)
            for t in runner.step().tokens:
                out.setdefault(slots[t.uid], []).append(t.token)
                finished += t.finish is not None
            step += 1
        return [out[i] for i in range(4)]

    engine, control = run(True), run(False)
    assert engine == control
    assert all(len(tokens) == 12 for tokens in engine)
