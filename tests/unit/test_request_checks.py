"""The worker's boundary checks, as properties: whatever a request carries, sampling values
either become a 400 naming the field or come out safe for MLX, and the samplers and logits
processors built from safe values run on a real logits row without raising."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxgw.shared.errors import ServiceError
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.runners.sampling import build_logits_processors, build_sampler, sampling_processor
from mlxgw.worker.schedule.request_checks import MAX_LOGIT_BIAS, SEED_RANGE, check_sampling

VOCAB = 512

extreme_ints = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63, 2**64 - 1, 2**64, -(2**63)]),
)
extreme_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-300, 1e300, math.nan, math.inf, -math.inf]),
)
anything = st.one_of(extreme_ints, extreme_floats, st.booleans(), st.none(), st.text(max_size=3))
bias = st.one_of(
    st.none(),
    st.dictionaries(extreme_ints, extreme_floats, max_size=8),
    st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=40),
    st.builds(lambda n: {i: 1.0 for i in range(n)}, st.integers(MAX_LOGIT_BIAS - 2, MAX_LOGIT_BIAS + 2)),
    st.dictionaries(anything, anything, max_size=3),
)
sampling = st.builds(
    SamplingParams,
    temperature=st.one_of(extreme_floats, anything),
    top_p=st.one_of(extreme_floats, st.floats(0, 1)),
    top_k=st.one_of(extreme_ints, anything),
    min_p=st.one_of(extreme_floats, st.floats(0, 1)),
    seed=st.one_of(st.none(), extreme_ints, anything),
    repetition_penalty=st.one_of(st.none(), extreme_floats),
    presence_penalty=extreme_floats,
    frequency_penalty=extreme_floats,
    logit_bias=bias,
)


def run_native(p: SamplingParams) -> None:
    """What the runner does with the values: build and apply every processor and sampler."""
    logits = mx.random.normal((1, VOCAB))
    tokens = mx.array([1, 2, 3])
    for proc in build_logits_processors(p):
        logits = proc(tokens, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = build_sampler(p)(logprobs)
    drawn = sampling_processor(p)(tokens, logits)
    mx.eval(token, drawn)
    assert 0 <= token.item() < VOCAB


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling)
def test_sampling_values_become_a_400_or_safe_for_mlx(p):
    try:
        safe = check_sampling(p, VOCAB)
    except ServiceError as e:
        assert e.status == 400 and e.param
        return
    assert 0 <= safe.top_k < VOCAB
    assert safe.seed is None or 0 <= safe.seed < SEED_RANGE
    assert all(math.isfinite(v) for v in (safe.temperature, safe.top_p, safe.min_p))
    assert len(safe.logit_bias or {}) <= MAX_LOGIT_BIAS
    assert all(0 <= k < VOCAB and math.isfinite(v) for k, v in (safe.logit_bias or {}).items())
    run_native(safe)


@pytest.mark.parametrize(
    "field,value",
    [("top_k", 100_000), ("seed", -1), ("seed", 2**64 + 5), ("top_k", VOCAB)],
)
def test_values_the_api_accepts_are_normalised_not_refused(field, value):
    safe = check_sampling(SamplingParams(temperature=0.7, **{field: value}), VOCAB)
    run_native(safe)


@pytest.mark.parametrize(
    "logit_bias",
    [{VOCAB: 1.0}, {-1: 1.0}, {i: 1.0 for i in range(100_000)}, {True: 1.0}, {1: math.nan}],
    ids=["id at vocab", "negative id", "100k entries", "bool id", "nan bias"],
)
def test_logit_bias_outside_the_model_is_refused(logit_bias):
    with pytest.raises(ServiceError) as refused:
        check_sampling(SamplingParams(logit_bias=logit_bias), VOCAB)
    assert refused.value.status == 400 and refused.value.param == "logit_bias"
