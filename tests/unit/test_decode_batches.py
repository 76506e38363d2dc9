"""Two decode batches (worker/model/runners/batch_generator.py): a row much longer than the
rows decoding starts in a batch beside theirs, where a forward of its own costs less than
padding them all to its length; every row keeps its tokens, its cancel and its cache.

The real MLXRunner on the tiny model. `forward_tokens` is set here to the rule's scale for
64-token rows (the worker derives it from the model: worker/process/build_mlx.py)."""

from __future__ import annotations

import pytest
from helpers.runner_jobs import generate_together

from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row
from mlxgw.worker.model.runners.batch_generator import side_is_cheaper

GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence
FORWARD_TOKENS = 64


def test_a_file_decodes_beside_two_dozen_short_rows_and_rows_of_similar_length_stay_together():
    ft = 40_000  # Qwen2.5-Coder-0.5B on the CPU device, measured (docs/operations.md)
    assert side_is_cheaper(4000, (24, 650), (0, 0), ft)  # an editor's keystroke beside 24 agents
    assert side_is_cheaper(4000, (24, 650), (1, 4000), ft)  # the next keystroke joins the first
    assert not side_is_cheaper(2000, (24, 1800), (0, 0), ft)  # agents of similar lengths: one batch
    assert not side_is_cheaper(4000, (3, 650), (0, 0), ft)  # padding three rows costs less than a forward
    assert not side_is_cheaper(50, (24, 650), (1, 4000), ft)  # a short chat joins the short rows


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        tiny_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=512,
        cache_bytes=64 << 20,
        speculative=SpeculativeConfig(mode="off"),
    )
    assert runner.generator.forward_tokens  # derived from the model's sizes
    return runner


@pytest.fixture
def batches(runner):
    """Sets forward_tokens for one test (None: one decode batch) on an empty cache."""

    def use(forward_tokens: int | None) -> None:
        runner.cache_clear()
        runner.generator.forward_tokens = forward_tokens

    yield use
    gen = runner.generator
    while gen.decoding or gen.reading or gen.queued:
        runner.step()


def _prompt(seed: int, length: int) -> list[int]:
    return [200 + (seed * 131 + i * 17) % 4000 for i in range(length)]


SHORT = [_prompt(i, 20 + 3 * i) for i in range(5)]
LONG = _prompt(9, 400)


def _kv_width(batch) -> int:
    return batch.prompt_cache[0]._idx if batch.prompt_cache else 0


def _short_rows_then_a_long_one(runner, long_max_tokens: int = 6) -> tuple[dict[int, list[int]], list[int]]:
    """Five short rows decode; a long row arrives after their second token. Each row's
    tokens by slot (the long row last) and the short rows' KV width while the long one decodes."""
    gen, out, slots, widths = runner.generator, {}, {}, []
    for i, p in enumerate(SHORT):
        slots[runner.insert(Row(p, 12, GREEDY))[0]] = i
    for _ in range(2):
        for t in runner.step().tokens:
            out.setdefault(slots[t.uid], []).append(t.token)
    long_uid = runner.insert(Row(LONG, long_max_tokens, GREEDY))[0]
    slots[long_uid] = len(SHORT)
    while gen.decoding or gen.reading:
        for t in runner.step().tokens:
            out.setdefault(slots[t.uid], []).append(t.token)
        if any(long_uid in b.uids for b in (gen._generation_batch, gen._side_batch)):
            widths.append(_kv_width(gen._generation_batch))
    return out, widths


def test_a_long_row_does_not_widen_the_short_rows_batch_and_changes_no_token(runner, batches):
    batches(None)
    one_batch, wide = _short_rows_then_a_long_one(runner)
    batches(FORWARD_TOKENS)
    two_batches, narrow = _short_rows_then_a_long_one(runner)
    assert two_batches == one_batch
    assert all(len(one_batch[i]) == 12 for i in range(len(SHORT))) and len(one_batch[len(SHORT)]) == 6
    assert max(wide) > len(LONG)  # one batch: the short rows attend over the long row's width
    assert max(narrow) < 60  # two: theirs stays their own


def test_a_cancelled_side_row_leaves_its_batch_and_its_kv_goes_to_the_prefix_cache(runner, batches):
    batches(FORWARD_TOKENS)
    gen = runner.generator
    short = [runner.insert(Row(p, 30, GREEDY))[0] for p in SHORT]
    runner.step()
    long_uid, _ = runner.insert(Row(LONG, 30, GREEDY))
    while long_uid not in gen._side_batch.uids:
        runner.step()
    held = gen.prompt_cache_nbytes
    runner.step()
    runner.remove([long_uid])
    assert gen.side_rows == 0 and gen.decoding == len(SHORT)
    assert gen.prompt_cache_nbytes < held  # the side batch's KV is counted, and gone with it
    runner.step()  # the short rows decode on
    _, cached = runner.insert(Row(LONG + [7], 2, GREEDY))
    assert cached >= len(LONG)  # its prompt and the tokens it had generated
    runner.remove(short)


def test_rows_placed_in_both_batches_in_one_step_keep_their_tokens(runner, batches):
    """Rows of different lengths that finish reading in the same step are split between the
    batches; each gets the tokens it gets alone in one batch."""
    jobs = [(p, 8) for p in (SHORT[0], LONG, SHORT[1], _prompt(11, 300))]
    batches(None)
    expected = generate_together(runner, jobs)
    batches(FORWARD_TOKENS)
    assert generate_together(runner, jobs) == expected
