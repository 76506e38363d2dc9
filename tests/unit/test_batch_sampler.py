"""The batch-wide sampler and penalties (worker/model/runners/batch_sampler.py) against
the per-row reference: the same masks, the same penalised logits bit for bit, the same
seeded tokens, the same distribution for unseeded rows; and through the real runner, greedy
tokens equal to mlx-lm's stream_generate and seeded tokens independent of the batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row
from mlxgw.worker.model.runners.batch_sampler import (
    PenaltyPlan,
    SamplePlan,
    apply_penalties,
    filter_rows,
    sample_rows,
    scores,
)
from mlxgw.worker.model.runners.sampling import RowPenalties, RowSampling, _filters

VOCAB = 1000

MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=20, seed=7),
    SamplingParams(temperature=1.3, min_p=0.05, seed=11),
    SamplingParams(temperature=0.5, top_p=0.5, top_k=50, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=0.9, top_p=0.95, seed=3),
    SamplingParams(temperature=0.0, seed=5),
]


def random_logprobs(rows: int, seed: int = 0, vocab: int = VOCAB) -> mx.array:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 4
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_filters_give_each_row_exactly_its_per_row_masks():
    rows = tuple(RowSampling(p) for p in MIXED)
    plan = SamplePlan.build(rows)
    x = random_logprobs(len(MIXED))
    filtered = filter_rows(x[mx.array(plan.drawn)], plan)
    for j, i in enumerate(plan.drawn):
        expected = x[i : i + 1]
        for f in _filters(MIXED[i]):
            expected = f(expected)
        assert np.array_equal(np.array(filtered[j : j + 1]), np.array(expected)), MIXED[i]


def test_only_rows_that_report_logprobs_or_are_seeded_are_normalised():
    """The full-vocabulary log-softmax is paid for the rows whose values are read (a row
    reporting logprobs) or must be bit-identical in any batch (a seeded row); the others keep
    their logits, which sample the same distribution and give the same argmax."""
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)]
    rows = [RowSampling(p) for p in params] + [RowSampling(SamplingParams(temperature=0.7))]
    rows[3].wants_logprobs = True
    logits = mx.random.normal((4, VOCAB), key=mx.random.key(1)) * 4 + 3
    got = scores(logits, SamplePlan.build(tuple(rows)))
    normalised = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for row, expected in ((0, logits), (1, logits), (2, normalised), (3, normalised)):
        assert mx.array_equal(got[row], expected[row]).item(), row
    plain = tuple(RowSampling(p) for p in params[:2])
    assert SamplePlan.build(plain).normalised is None
    every = tuple(RowSampling(SamplingParams(temperature=0.7, seed=s)) for s in range(4))
    assert mx.array_equal(scores(logits, SamplePlan.build(every)), normalised).item()


def test_filtering_leaves_the_logprobs_it_was_given_unchanged():
    rows = tuple(RowSampling(p) for p in MIXED)
    x = random_logprobs(len(MIXED))
    before = np.array(x)
    mx.eval(sample_rows(x, SamplePlan.build(rows)))
    assert np.array_equal(np.array(x), before)


def test_seeded_and_greedy_rows_draw_the_per_row_samplers_tokens_step_after_step():
    batch = tuple(RowSampling(p) for p in MIXED)
    alone = [RowSampling(p) for p in MIXED]
    plan = SamplePlan.build(batch)
    for step in range(6):
        x = random_logprobs(len(MIXED), seed=100 + step)
        drawn = sample_rows(x, plan).tolist()
        for i, p in enumerate(MIXED):
            if p.temperature <= 0 or p.seed is not None:
                assert drawn[i] == alone[i](x[i : i + 1]).item(), (step, p)


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    seeded = SamplingParams(temperature=0.9, top_k=30, seed=42)
    compositions = [[seeded], [SamplingParams(temperature=0.0), seeded], MIXED[:3] + [seeded] + MIXED[3:]]
    streams = []
    for params in compositions:
        rows = tuple(RowSampling(p) for p in params)
        plan, at = SamplePlan.build(rows), params.index(seeded)
        tokens = []
        for step in range(5):
            x = random_logprobs(len(params), seed=200 + step)
            row = random_logprobs(1, seed=300 + step)  # the seeded request's own distribution
            x = mx.concatenate([x[:at], row, x[at + 1 :]])
            tokens.append(sample_rows(x, plan)[at].item())
        streams.append(tokens)
    assert streams[0] == streams[1] == streams[2]


def test_unseeded_rows_sample_each_rows_own_filtered_distribution():
    """Rows of different temperatures and filters, 400 draws each: every row's token
    frequencies match its truncated, tempered softmax (chi-square), and no masked token is drawn."""
    mx.random.seed(1234)
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    small = random_logprobs(len(params), seed=9, vocab=8)
    rows = tuple(RowSampling(p) for p in params)
    plan = SamplePlan.build(rows)
    copies = 50
    tiled = tuple(RowSampling(p) for _ in range(copies) for p in params)
    tiled_plan = SamplePlan.build(tiled)
    x = mx.concatenate([small] * copies)
    counts = np.zeros((len(params), 8))
    for _ in range(8):
        drawn = np.array(sample_rows(x, tiled_plan)).reshape(copies, len(params))
        for i in range(len(params)):
            counts[i] += np.bincount(drawn[:, i], minlength=8)
    filtered = filter_rows(small, plan)
    for i, p in enumerate(params):
        probs = np.array(mx.softmax(filtered[i] * (1 / p.temperature)))
        assert counts[i][probs == 0].sum() == 0
        keep = probs > 0
        expected = probs[keep] * counts[i].sum()
        chi2 = (((counts[i][keep] - expected) ** 2) / expected).sum()
        assert chi2 < 30, (p, counts[i], probs)  # 7 degrees of freedom at most: p < 1e-4


def test_a_wide_batch_drawn_in_groups_of_rows_keeps_each_row_its_own_token():
    """On a CPU a 49k-wide batch is drawn a few rows per call: row i, which allows only
    token 7 * i, still gets token 7 * i."""
    rows, width = 7, 49152
    allowed = mx.arange(width)[None] == (7 * mx.arange(rows))[:, None]
    logprobs = mx.where(allowed, 0.0, -float("inf"))
    plan = SamplePlan.build(tuple(RowSampling(SamplingParams(temperature=1.0)) for _ in range(rows)))
    assert sample_rows(logprobs, plan).tolist() == [7 * i for i in range(rows)]


def test_a_row_whose_values_mlx_refuses_faults_only_itself():
    """top_k past the vocabulary (the boundary clamps it; here it slips through): the batched
    draw falls back to row by row, that row's guard records the fault, the others sample."""
    from mlxgw.worker.model.runners.batch_sampler import VectorGenerationBatch
    from mlxgw.worker.model.runners.isolation import SequenceGuard

    guards = [SequenceGuard(f"r{i}") for i in range(3)]
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=VOCAB + 5), SamplingParams(seed=1)]
    rows = tuple(RowSampling(p, g) for p, g in zip(params, guards))
    batch = VectorGenerationBatch.empty(None, None)
    x = random_logprobs(3)
    tokens = batch.sample(x, rows).tolist()
    assert [g.faulted for g in guards] == [False, True, False]
    assert tokens[0] == mx.argmax(x[0]).item()
    assert tokens[2] == RowSampling(params[2])(x[2:3]).item()


def test_a_fault_inside_a_compiled_filter_leaves_the_random_state_usable_for_everyone():
    """mlx-lm's filters are compiled with MLX's global random state as an output; one that
    raises while tracing (a fresh shape, top_k past the vocabulary) left the state as a
    placeholder, and every later unseeded draw in the worker failed. The guard reseeds."""
    from mlxgw.worker.model.runners.batch_sampler import VectorGenerationBatch
    from mlxgw.worker.model.runners.isolation import SequenceGuard

    width = 1237  # a width no other test traces the filters with
    guards = [SequenceGuard("ok"), SequenceGuard("bad")]
    rows = (
        RowSampling(SamplingParams(temperature=1.0), guards[0]),
        RowSampling(SamplingParams(top_k=width + 1), guards[1]),
    )
    x = random_logprobs(2, vocab=width)
    VectorGenerationBatch.empty(None, None).sample(x, rows).tolist()
    assert [g.faulted for g in guards] == [False, True]
    mx.eval(mx.random.state)  # raised "eval an array without a primitive" before the fix
    assert 0 <= mx.random.categorical(x[0]).item() < width


PENALISED = [
    SamplingParams(frequency_penalty=0.5),
    SamplingParams(presence_penalty=0.8, logit_bias={3: 5.0, 17: -100.0}),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, presence_penalty=-0.4, frequency_penalty=1.1, logit_bias={5: 2.5}),
    SamplingParams(logit_bias={0: 1.0, 999: -3.0}),
]


@pytest.mark.parametrize("lengths", [(1, 5, 19, 40, 300), (600, 256, 257, 2, 21)])
def test_penalties_and_bias_equal_the_per_row_processors_bit_for_bit(lengths):
    rng = np.random.default_rng(sum(lengths))
    # few distinct tokens, so windows repeat tokens (frequency counts above one)
    contexts = [mx.array(rng.integers(0, 40, n), dtype=mx.int32) for n in lengths]
    processors = tuple(RowPenalties(p) for p in PENALISED)
    logits = mx.random.normal((len(PENALISED), VOCAB), key=mx.random.key(3)) * 3
    plan = PenaltyPlan.build(processors, list(range(len(PENALISED))), len(PENALISED))
    batched = apply_penalties(logits, plan, contexts)
    for i, proc in enumerate(processors):
        assert np.array_equal(np.array(batched[i : i + 1]), np.array(proc.apply(contexts[i], logits[i : i + 1])))


def test_penalties_on_some_rows_leave_the_others_untouched():
    processors = tuple(RowPenalties(p) for p in PENALISED[:2])
    logits = mx.random.normal((4, VOCAB), key=mx.random.key(4))
    contexts = [mx.array([1, 2, 2, 3], dtype=mx.int32), mx.array([3], dtype=mx.int32)]
    plan = PenaltyPlan.build(processors, [1, 3], 4)
    out = apply_penalties(logits, plan, contexts)
    for i in (0, 2):
        assert np.array_equal(np.array(out[i]), np.array(logits[i]))
    for j, i in enumerate((1, 3)):
        assert np.array_equal(np.array(out[i : i + 1]), np.array(processors[j].apply(contexts[j], logits[i : i + 1])))


# -- through the real runner ---------------------------------------------------------------
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def decode(runner, requests: list[tuple[str, SamplingParams]], max_tokens: int) -> list[list[int]]:
    """Every request inserted at once into the runner's batch; each one's tokens."""
    uids = [runner.insert(Row(runner.encode_text(text), max_tokens, params))[0] for text, params in requests]
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    done: set[int] = set()
    while len(done) < len(uids):
        for out in runner.step().tokens:
            tokens[out.uid].append(out.token)
            if out.finish is not None:
                done.add(out.uid)
    return [tokens[uid] for uid in uids]


@pytest.fixture(scope="module")
def tiny_runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=8, prefill_step_size=64, cache_bytes=0)


def test_greedy_rows_in_a_mixed_batch_equal_mlx_lm_stream_generate(tiny_runner):
    from mlx_lm import stream_generate

    runner = tiny_runner
    greedy = SamplingParams(temperature=0.0)
    others = [(PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9)), (PROMPTS[2], SamplingParams(seed=1))]
    batch = decode(runner, [(PROMPTS[0], greedy), *others, (PROMPTS[3], greedy)], 12)
    for text, got in ((PROMPTS[0], batch[0]), (PROMPTS[3], batch[3])):
        prompt = runner.encode_text(text)
        expected = [r.token for r in stream_generate(runner.model, runner.tokenizer, prompt, max_tokens=12)]
        assert got == expected[: len(got)] and len(got) in (12, len(expected)), text


MIXED_REQUESTS = [
    (PROMPTS[0], SamplingParams(temperature=0.9, top_k=40, seed=1)),
    (PROMPTS[1], SamplingParams(temperature=0.0, frequency_penalty=0.7)),
    (PROMPTS[2], SamplingParams(temperature=1.1, top_p=0.9, min_p=0.01, seed=2, presence_penalty=0.5)),
    (PROMPTS[3], SamplingParams(temperature=0.7, repetition_penalty=1.2, logit_bias={11: 3.0})),
    (PROMPTS[0], SamplingParams(temperature=1.0, seed=3)),
]


def test_each_seeded_request_gives_the_tokens_it_gives_alone(tiny_runner):
    batch = decode(tiny_runner, MIXED_REQUESTS, 10)
    for request, got in zip(MIXED_REQUESTS, batch):
        if request[1].seed is not None:
            assert got == decode(tiny_runner, [request], 10)[0], request


def test_the_batched_step_equals_mlx_lms_per_row_step(tiny_runner):
    """Seeded and greedy rows (penalties, bias, filters) through the batch-wide step and
    through mlx-lm's own per-row step: the same tokens."""
    requests = [r for r in MIXED_REQUESTS if r[1].seed is not None or r[1].temperature == 0]
    batched = decode(tiny_runner, requests, 10)
    tiny_runner.generator.vectorized = False
    try:
        per_row = decode(tiny_runner, requests, 10)
    finally:
        tiny_runner.generator.vectorized = True
    assert batched == per_row


def test_smollm2_greedy_rows_in_a_sampled_batch_equal_stream_generate(smollm2_dir):
    from mlx_lm import stream_generate

    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(smollm2_dir, context_length=None, max_num_seqs=4, prefill_step_size=64, cache_bytes=0)
    greedy = SamplingParams(temperature=0.0)
    requests = [
        (PROMPTS[0], greedy),
        (PROMPTS[1], SamplingParams(temperature=0.8, frequency_penalty=0.5)),
        (PROMPTS[2], greedy),
    ]
    batch = decode(runner, requests, 8)
    for text, got in ((PROMPTS[0], batch[0]), (PROMPTS[2], batch[2])):
        prompt = runner.encode_text(text)
        expected = [r.token for r in stream_generate(runner.model, runner.tokenizer, prompt, max_tokens=8)]
        assert got == expected[: len(got)] and len(got) in (8, len(expected)), text
