"""The output head stored transposed (worker/model/cpu/output_head.py): the same logits, the same
vocabulary size, no more memory, tied and untied heads, left alone where it does not apply
and where this host runs the checkpoint's layout faster."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxgw.worker.model import model_info
from mlxgw.worker.model.cpu.output_head import TransposedEmbedding, TransposedHead, measure_layouts, transpose_head


def _always(weight, weight_t):
    return True


def _nbytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _logits(model, tokens):
    from mlx_lm.models.cache import make_prompt_cache

    return model(mx.array([tokens]), cache=make_prompt_cache(model))


def test_a_tied_head_gives_the_same_logits_in_the_same_memory(tiny_dir):
    from mlx_lm import load

    plain, tokenizer = load(str(tiny_dir))
    model, _ = load(str(tiny_dir))
    before = _nbytes(model)
    assert transpose_head(model, choose=_always) == "model.embed_tokens"
    assert isinstance(model.model.embed_tokens, TransposedEmbedding)
    assert _nbytes(model) == before
    assert model_info.vocab_size(model, tokenizer) == model_info.vocab_size(plain, tokenizer)
    tokens = list(range(3, 120))
    assert mx.allclose(_logits(model, tokens), _logits(plain, tokens), atol=1e-4)
    # lookups of the first, last and repeated ids
    ids = mx.array([[0, 5, 5, model.model.embed_tokens.weight.shape[0] - 1]])
    assert mx.array_equal(model.model.embed_tokens(ids), plain.model.embed_tokens(ids))


def test_an_untied_head_keeps_its_bias_and_gives_the_same_product():
    linear = nn.Linear(16, 40, bias=True)
    head = TransposedHead(linear)
    x = mx.random.normal((3, 2, 16))
    assert mx.allclose(head(x), linear(x), atol=1e-5)
    assert head.weight.shape == linear.weight.shape


class _Untied(nn.Module):
    def __init__(self, dtype=mx.float32):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 8)
        self.lm_head = nn.Linear(8, 50, bias=False)
        self.update(tree_map_dtype(self.parameters(), dtype))

    def __call__(self, ids):
        return self.lm_head(self.embed_tokens(ids))


def tree_map_dtype(params, dtype):
    from mlx.utils import tree_map

    return tree_map(lambda a: a.astype(dtype), params)


def test_an_lm_head_is_transposed_and_the_embedding_left_alone():
    model = _Untied()
    ids = mx.array([[1, 2, 3]])
    expected = model(ids)
    assert transpose_head(model, choose=_always) == "lm_head"
    assert isinstance(model.lm_head, TransposedHead) and type(model.embed_tokens) is nn.Embedding
    assert mx.allclose(model(ids), expected, atol=1e-5)


def test_half_precision_and_the_switch_leave_the_head_as_it_is(monkeypatch):
    assert transpose_head(_Untied(mx.float16)) is None
    monkeypatch.setenv("MLXGW_TRANSPOSED_HEAD", "0")
    assert transpose_head(_Untied()) is None


def test_where_the_host_runs_the_checkpoints_layout_faster_the_head_is_left_alone():
    model = _Untied()
    head = model.lm_head
    seen = []

    def slower(weight, weight_t):
        seen.append((weight.shape, weight_t.shape))
        return False

    assert transpose_head(model, choose=slower) is None
    assert model.lm_head is head
    assert seen == [((50, 8), (8, 50))]


def test_the_layouts_are_measured_on_this_host(monkeypatch):
    weight = mx.random.normal((4096, 64))
    ratio = measure_layouts(weight, mx.contiguous(weight.T))
    assert 0.05 < ratio < 20
    monkeypatch.setenv("MLXGW_TRANSPOSED_HEAD", "1")  # forced: no measurement decides
    assert transpose_head(_Untied(), choose=None) == "lm_head"
