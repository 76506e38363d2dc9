"""KV-shift reuse for fill-in-the-middle (worker/model/cache/kv_shift.py): which models may move
cached keys, and that a moved key is the key computed at its new position."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlxgw.worker.model.cache.kv_shift import ShiftReuse, find_rope
from mlxgw.worker.model.cache.quantized_kv import quantize_layers

TINY = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=64, rope_theta=10000.0,
)  # fmt: skip


def tiny(**overrides):
    return llama.Model(llama.ModelArgs(**{**TINY, **overrides}))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("scaling", [None, {**LLAMA3, "original_max_position_embeddings": 64}])
def test_a_moved_key_equals_the_key_computed_at_its_new_position(scaling):
    model = tiny(rope_scaling=scaling)
    reuse = ShiftReuse.for_model(model, make_prompt_cache(model), fim_middle=5, min_tokens=8)
    assert reuse is not None
    rope = find_rope(model)
    raw = mx.random.normal((1, 2, 40, 16), key=mx.random.key(0))
    at_7, at_12, at_3 = rope(raw, offset=7), rope(raw, offset=12), rope(raw, offset=3)
    assert mx.allclose(reuse._rotate(at_7, 5), at_12, atol=1e-5)  # text inserted before it
    assert mx.allclose(reuse._rotate(at_7, -4), at_3, atol=1e-5)  # text deleted before it


def test_models_whose_keys_cannot_be_moved_keep_the_plain_prefix_lookup():
    model = tiny()
    assert ShiftReuse.for_model(model, make_prompt_cache(model), fim_middle=None, min_tokens=8) is None  # no FIM
    assert ShiftReuse.for_model(model, make_prompt_cache(model), fim_middle=5, min_tokens=0) is None  # off
    quantized = quantize_layers(make_prompt_cache(model), 64, 8)
    assert ShiftReuse.for_model(model, quantized, fim_middle=5, min_tokens=8) is None
    yarn = tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert ShiftReuse.for_model(yarn, make_prompt_cache(yarn), fim_middle=5, min_tokens=8) is None  # scales magnitude
