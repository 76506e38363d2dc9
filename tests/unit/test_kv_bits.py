"""kv_bits: quantized KV under continuous batching (worker/model/cache/quantized_kv.py).

A tiny random llama with 64-wide heads (quantization groups of 32/64 need it) runs with
8- and 4-bit KV in the worker's real engine: four rows at once give each row's own tokens,
a prefix-cache hit gives the cold run's tokens, prompt-lookup speculation gives plain
greedy's, and the KV takes the bytes per token the capacity formula says."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.family_models import WIDE_HEADS, build_family_model
from helpers.runner_jobs import GREEDY, generate_together

from mlxgw.shared.model_sections import CacheConfig, SpeculativeConfig
from mlxgw.worker.model.interfaces import Row


@pytest.fixture(scope="module")
def wide_dir(home, smollm2_dir):
    return build_family_model("llama", home / "models" / "kv-llama", smollm2_dir, overrides=WIDE_HEADS)


def _runner(model_dir, bits, speculative="off", cache_bytes=64 << 20):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        model_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=32,
        cache_bytes=cache_bytes,
        speculative=SpeculativeConfig(mode=speculative),
        cache=CacheConfig(kv_bits=bits, kv_group_size=32),
    )


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(f"{n} little pigs built a house of straw and sticks. " * n) for n in (1, 2, 3, 4)]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_batches_caches_and_speculates_with_the_same_tokens(wide_dir, bits):
    runner = _runner(wide_dir, bits, cache_bytes=0)
    prompts = _prompts(runner.tokenizer)
    alone = [generate_together(runner, [(p, 12)])[0] for p in prompts]
    assert generate_together(runner, [(p, 12) for p in prompts]) == alone  # four at once
    cached = _runner(wide_dir, bits)
    cold = generate_together(cached, [(prompts[3], 12)])[0]
    uid, hit = cached.insert(Row(prompts[3], 12, GREEDY))
    assert hit == len(prompts[3]) - 1
    out = []
    while len(out) < 12:
        out += [t.token for t in cached.step().tokens if t.uid == uid]
    assert out == cold == alone[3]
    spec = _runner(wide_dir, bits, speculative="prompt_lookup", cache_bytes=0)
    echoed = [p + a + p for p, a in zip(prompts, alone)]
    plain = [generate_together(runner, [(p, 12)])[0] for p in echoed]
    assert [generate_together(spec, [(p, 12)])[0] for p in echoed] == plain
    assert spec.stats()["speculative"]["speculative_steps"] > 0


def test_quantized_kv_takes_the_bytes_per_token_the_capacity_formula_counts(wide_dir):
    import json

    from mlxgw.worker.model.memory.capacity import choose_max_num_seqs, kv_bytes_per_token

    config = json.loads((wide_dir / "config.json").read_text())
    measured = {}
    for bits in (None, 8, 4):
        runner = _runner(wide_dir, bits, cache_bytes=64 << 20)
        prompt = _prompts(runner.tokenizer)[3]
        generate_together(runner, [(prompt, 1)])
        (entry,) = list(runner.prefix_cache.entries())
        measured[bits] = entry.nbytes / len(entry.tokens)
        formula = kv_bytes_per_token(config, 4, bits, 32)
        assert measured[bits] == pytest.approx(formula, rel=0.02), bits
    # A float32 model, groups of 32: (bits/8 + 2 x 4/32) bytes per element against 4.
    assert measured[8] / measured[None] == pytest.approx(1.25 / 4, rel=0.02)
    assert measured[4] / measured[None] == pytest.approx(0.75 / 4, rel=0.02)
    plain = choose_max_num_seqs(None, wide_dir, 1 << 30)
    quantized = choose_max_num_seqs(None, wide_dir, 1 << 30, 4, 32)
    assert quantized.kv_bytes_per_token < plain.kv_bytes_per_token and quantized.value >= plain.value


def test_quantized_kv_agrees_with_mlx_lm_quantized_generation(wide_dir):
    """mlx-lm quantizes after each prefill chunk, the engine from the first write: the KV is
    the same quantization of nearly the same values, so greedy text mostly agrees."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    runner = _runner(wide_dir, 8, cache_bytes=0)
    agree = total = 0
    for p in _prompts(runner.tokenizer):
        ours = generate_together(runner, [(p, 12)])[0]
        steps = stream_generate(
            runner.model,
            runner.tokenizer,
            mx.array(p),
            max_tokens=12,
            sampler=make_sampler(0.0),
            kv_bits=8,
            kv_group_size=32,
            quantized_kv_start=0,
        )
        ref = [s.token for s in steps]
        agree += sum(a == b for a, b in zip(ours, ref))
        total += len(ref)
    assert agree >= 0.75 * total


def test_quantized_entries_go_to_the_disk_tier_and_come_back(wide_dir, tmp_path):
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    def runner():
        store = PrefixStore(tmp_path / "store", model_fingerprint(wide_dir), 64 << 20)
        return build_mlx_runner(
            wide_dir,
            context_length=None,
            max_num_seqs=8,
            prefill_step_size=32,
            cache_bytes=64 << 20,
            speculative=SpeculativeConfig(mode="off"),
            cache=CacheConfig(kv_bits=8, kv_group_size=32),
            prefix_store=store,
        )

    first = runner()
    prompt = _prompts(first.tokenizer)[2]
    expected = generate_together(first, [(prompt, 6)])[0]
    saved = first.prefix_store.save(first.prefix_cache)["saved_blocks"]
    assert saved == len(first.prefix_cache.tree.blocks)
    again = runner()
    assert again.prefix_store.restore(again.prefix_cache)["indexed_blocks"] == saved
    uid, hit = again.insert(Row(prompt, 6, GREEDY))
    assert hit == len(prompt) - 1
    out = []
    while len(out) < 6:
        out += [t.token for t in again.step().tokens if t.uid == uid]
    assert out == expected
