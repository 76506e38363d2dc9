"""The worker's CPU attention (worker/model/cpu/cpu_attention.py) gives mlx-lm's attention to float32
rounding, in every layout and mask mlx-lm's models pass, on one stream and split over two;
and hands what it does not handle to mlx-lm's own function. The family matrix
(tests/e2e/test_families.py) checks greedy tokens against mlx-lm's attention over every family."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxgw.worker.model.cpu import cpu_attention

TOLERANCE = 2e-5


@pytest.fixture(scope="module", autouse=True)
def installed():
    import mlx_lm.models.llama  # noqa: F401  (a model module to route)

    assert cpu_attention.install()
    yield


def _inputs(B, Hq, Hk, L, T, D=64, Dv=None, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, Hq, L, D))
    k = mx.random.normal((B, Hk, T, D))
    v = mx.random.normal((B, Hk, T, Dv or D))
    return q, k, v


def _mask(kind, B, L, T):
    if kind in (None, "causal"):
        return kind
    keep = mx.random.uniform(shape=(B, 1, L, T)) > 0.3
    keep = mx.concatenate([keep[..., :-1], mx.ones((B, 1, L, 1), dtype=mx.bool_)], axis=-1)  # each row sees a key
    return keep if kind == "bool" else mx.where(keep, 0.0, -1e9)


def _both(q, k, v, mask, scale=0.125):
    ours = cpu_attention.attention(q, k, v, None, scale, mask)
    theirs = cpu_attention._original(q, k, v, cache=None, scale=scale, mask=mask)
    return ours, theirs


SHAPES = [
    # B, Hq, Hk, L, T: decode with grouped heads, multi-head, a speculative verify, a prefill chunk
    (1, 9, 3, 1, 40),
    (16, 9, 3, 1, 120),
    (4, 8, 8, 1, 300),
    (2, 9, 3, 5, 90),
    (1, 4, 2, 64, 200),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_matches_mlx_lm_on_one_stream(shape, mask):
    B, Hq, Hk, L, T = shape
    q, k, v = _inputs(B, Hq, Hk, L, T)
    ours, theirs = _both(q, k, v, _mask(mask, B, L, T))
    assert ours.shape == theirs.shape
    assert mx.abs(ours - theirs).max().item() < TOLERANCE


@pytest.mark.parametrize("mask", [None, "causal", "bool"])
@pytest.mark.parametrize("shape", [(16, 9, 3, 1, 600), (1, 4, 1, 128, 1024)])
def test_rows_split_over_two_streams_match_mlx_lm(shape, mask):
    B, Hq, Hk, L, T = shape
    assert B * Hq * L * T >= cpu_attention.SPLIT_MIN_SCORES and T >= cpu_attention.SPLIT_MIN_KEYS
    q, k, v = _inputs(B, Hq, Hk, L, T, seed=1)
    cpu_attention.settings.parallel = True
    ours, theirs = _both(q, k, v, _mask(mask, B, L, T))
    assert mx.abs(ours - theirs).max().item() < TOLERANCE
    assert cpu_attention.settings.second_stream is not None


def test_a_left_padded_row_that_sees_nothing_in_one_half_is_not_nan():
    """BatchKVCache left-pads short rows: a row's first half of keys can be all masked."""
    B, Hq, Hk, L, T = 2, 9, 3, 1, 4096
    q, k, v = _inputs(B, Hq, Hk, L, T, seed=2)
    keep = mx.ones((B, 1, L, T), dtype=mx.bool_)
    keep = mx.concatenate([keep[:1], mx.concatenate([mx.zeros((1, 1, 1, 3000), mx.bool_), keep[1:, ..., 3000:]], -1)])
    cpu_attention.settings.parallel = True
    ours, theirs = _both(q, k, v, keep)
    assert not mx.isnan(ours).any().item()
    assert mx.abs(ours - theirs).max().item() < TOLERANCE


def test_a_value_width_other_than_the_key_width():
    """MLA families (deepseek_v3) attend with 192-wide keys and 128-wide values."""
    q, k, v = _inputs(2, 4, 4, 1, 50, D=192, Dv=128)
    ours, theirs = _both(q, k, v, None)
    assert ours.shape == (2, 4, 1, 128)
    assert mx.abs(ours - theirs).max().item() < TOLERANCE


def test_what_it_does_not_handle_goes_to_mlx_lm_unchanged():
    q, k, v = _inputs(1, 4, 4, 1, 30)
    sinks = mx.zeros((4,))
    assert mx.array_equal(
        cpu_attention.attention(q, k, v, None, 0.125, None, sinks=sinks),
        cpu_attention._original(q, k, v, cache=None, scale=0.125, mask=None, sinks=sinks),
    )
    # a mask kind it does not know is mlx-lm's to accept or refuse, as it would be without it
    with pytest.raises(Exception) as theirs:
        cpu_attention._original(q, k, v, cache=None, scale=0.125, mask="sliding")
    with pytest.raises(type(theirs.value)):
        cpu_attention.attention(q, k, v, None, 0.125, "sliding")
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert mx.array_equal(
        cpu_attention.attention(*half, None, 0.125, None),
        cpu_attention._original(*half, cache=None, scale=0.125, mask=None),
    )


def test_bypassed_gives_mlx_lms_own_result():
    q, k, v = _inputs(3, 9, 3, 1, 70)
    with cpu_attention.bypassed():
        inside = cpu_attention.attention(q, k, v, None, 0.125, None)
    assert mx.array_equal(inside, cpu_attention._original(q, k, v, cache=None, scale=0.125, mask=None))
    assert cpu_attention.settings.enabled


def test_model_modules_are_routed_and_a_model_gives_the_same_greedy_tokens(tiny_dir):
    """A real model's forward goes through it, with the same argmax as with mlx-lm's attention."""
    import mlx_lm.models.llama as llama
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(tiny_dir))
    cpu_attention.install()
    assert llama.scaled_dot_product_attention is cpu_attention.attention
    prompt = mx.array([list(range(3, 300))])
    ours = model(prompt, cache=make_prompt_cache(model))
    with cpu_attention.bypassed():
        theirs = model(prompt, cache=make_prompt_cache(model))
    assert mx.abs(ours - theirs).max().item() < 1e-3
    assert mx.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_cpu_forward_bench_runs_every_table(tiny_dir):
    """bench/step/cpu_forward.py (the figures in bench/step/README.md) on the tiny model, one round."""
    from mlx_lm import load

    from mlxgw.bench.step import cpu_forward

    model, _ = load(str(tiny_dir))
    rows = cpu_forward.attention_rounds(mx, (4, 2, 16), rounds=2, repeats=1)
    rows += cpu_forward.head_rounds(mx, model, rounds=1, repeats=1)
    rows += cpu_forward.prefill_rounds(mx, model, tokens=64, rounds=1)
    assert [r["what"] for r in rows].count("attention") == len(cpu_forward.DECODE) + 1
    assert {r["what"] for r in rows} == {"attention", "head", "prefill", "decode step"}
    assert all(r["mlxgw"]["median"] > 0 and r["mlx_lm"]["median"] > 0 for r in rows)
    assert "| attention |" in cpu_forward.markdown(rows)
    assert cpu_attention.settings.enabled
