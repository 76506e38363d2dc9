"""The family matrix: every mlx-lm family a team runs loads, batches, keeps its prefix cache
and speculates, with the same greedy tokens as mlx-lm's own stream_generate.

Each family is a tiny random-weight model built from mlx-lm 0.32.2's own classes
(tests/helpers/family_models.py: every layer kind, non-flat logits), driven through the
worker's real engine in-process (MLXRunner: BatchGenerator, prefix cache, speculation).
Per family: parity alone, from the prefix cache (a repeat, a prompt sharing the system
prompt, the next turn, each reusing what it shares), four at once, and with prompt-lookup
speculation. A mismatch at a position where the reference's top two logits are exactly
equal counts as a tie, not a failure. Set FAMILY_TABLE=path to get the table as JSON lines."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest
from helpers.family_models import FAMILIES, NON_TRIMMABLE, WIDE_HEADS, build_family_model
from helpers.greedy_parity import assert_greedy_equal
from helpers.runner_jobs import generate_together, run_alone

from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.worker.model.cpu.cpu_attention import bypassed
from mlxgw.worker.model.interfaces import Row

TOKENS = 8
SYSTEM = "You are a careful assistant for a team of engineers. Answer briefly and cite the file. " * 2
ORDERED_FAMILIES = list(FAMILIES)


def _reference(model, tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm alone: stream_generate, greedy, with mlx-lm's own attention (the worker routes
    its model modules through worker/model/cpu/cpu_attention.py, process-wide)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    with bypassed():
        steps = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens, sampler=make_sampler(0.0))
        return [r.token for r in steps]


def _run(runner, prompt: list[int], max_tokens: int = TOKENS) -> tuple[list[int], int]:
    return run_alone(runner, prompt, max_tokens)


def _chat(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def family_dirs(home, smollm2_dir):
    root = home / "models"
    return {f: build_family_model(f, root / f"fam-{f}", smollm2_dir) for f in ORDERED_FAMILIES}


def _record(row: dict) -> None:
    path = os.environ.get("FAMILY_TABLE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("family", ORDERED_FAMILIES)
def test_family_has_parity_alone_batched_speculating_and_from_its_prefix_cache(family, family_dirs):
    from mlx_lm.models.cache import make_prompt_cache

    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        family_dirs[family],
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=32,  # several prefill chunks per prompt, as long prompts have
        cache_bytes=64 << 20,
        speculative=SpeculativeConfig(mode="off"),
    )
    tok, model = runner.tokenizer, runner.model
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the scheduler?"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who owns the cache code?"}]
    p1, p2 = _chat(tok, first), _chat(tok, other)
    ref1 = _reference(model, tok, p1, 2 * TOKENS)

    # Alone, then the same prompt again: resumed just before its last token.
    out, cached = _run(runner, p1)
    assert cached == 0
    assert_greedy_equal(model, p1, ref1[:TOKENS], out, "alone")
    out, repeat = _run(runner, p1)
    assert_greedy_equal(model, p1, ref1[:TOKENS], out, "repeat from the cache")
    assert repeat == len(p1) - 1

    # A new prompt sharing the system prompt: resumed at the message boundary at least.
    out, shared = _run(runner, p2)
    assert_greedy_equal(model, p2, _reference(model, tok, p2, TOKENS), out, "shared system prompt")
    system_end = p1.index(tok.convert_tokens_to_ids("<|im_start|>"), 1)  # where the user turn opens
    assert shared >= system_end and shared < _shared_prefix(p1, p2) + 1

    # The next turn of the first conversation: resumes at least where the first prompt ended.
    answer = tok.decode(ref1[:TOKENS])
    p3 = _chat(tok, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And tests?"}])
    out, next_turn = _run(runner, p3)
    assert_greedy_equal(model, p3, _reference(model, tok, p3, TOKENS), out, "next turn")
    assert next_turn >= min(len(p1), _shared_prefix(p1, p3)) - 1

    # Four at once (no cache help): rows of different lengths prefill and decode together.
    runner.cache_clear()
    raw = [tok.encode("the quick brown fox " * n) for n in (3, 5)]
    prompts = [p1, p2, *raw]
    refs = [ref1[:TOKENS]] + [_reference(model, tok, p, TOKENS) for p in prompts[1:]]
    for p, r, o in zip(prompts, refs, generate_together(runner, [(p, TOKENS) for p in prompts])):
        assert_greedy_equal(model, p, r, o, "four at once")
    # The same four in two decode batches: with a forward costing one token of attention,
    # a row shorter than the rows decoding starts beside them (worker/model/runners/batch_generator.py).
    runner.cache_clear()
    runner.generator.forward_tokens = 1
    for p, r, o in zip(prompts, refs, generate_together(runner, [(p, TOKENS) for p in prompts])):
        assert_greedy_equal(model, p, r, o, "four at once, two decode batches")
    assert runner.stats()["side_batch"]["started"] > 0
    stats = runner.cache_stats()
    assert stats["bytes"] <= stats["max_bytes"]
    if family in NON_TRIMMABLE:
        assert stats["checkpoints"] > 0 and stats["checkpoint_bytes"] > 0

    # Prompt-lookup speculation, four rows: the same tokens as plain greedy decoding. The CPU
    # device does not speculate above 2 rows by default (worker/model/speculation/speculative.py, CPU_MAX_ROWS);
    # a GPU does, so batched verification is checked here with the cap lifted.
    spec = build_mlx_runner(
        family_dirs[family],
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=256,
        cache_bytes=0,
        speculative=SpeculativeConfig(mode="prompt_lookup", max_rows=8),
    )
    # Each prompt, its own continuation and the prompt again: its context then holds n-grams
    # the model is likely to produce, so prompt lookup drafts (accepted or not).
    echoed = [p + r + p for p, r in zip(prompts, refs)]
    long_refs = [_reference(model, tok, p, 2 * TOKENS) for p in echoed]
    for p, r in zip(echoed, long_refs):  # alone (every step can verify the row's draft) until one did
        assert_greedy_equal(model, p, r, generate_together(spec, [(p, 2 * TOKENS)])[0], "speculating alone")
        if spec.stats()["speculative"]["speculative_steps"]:
            break
    for p, r, o in zip(echoed, long_refs, generate_together(spec, [(p, 2 * TOKENS) for p in echoed])):
        assert_greedy_equal(model, p, r, o, "speculating, four rows")
    speculated = spec.stats()["speculative"]
    assert speculated["speculative_steps"] > 0, "speculation never ran"
    _record(
        {
            "family": family,
            "cache": sorted({type(c).__name__ for c in make_prompt_cache(model)}),
            "prompt": len(p1),
            "repeat": repeat,
            "shared": f"{shared}/{_shared_prefix(p1, p2)}",
            "next_turn": f"{next_turn}/{_shared_prefix(p1, p3)}",
            "drafted": speculated["drafted_tokens"],
            "accepted": speculated["accepted_tokens"],
        }
    )


def _hybrid_runner(model_dir, cache_bytes: int = 64 << 20, prefix_store=None):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        model_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=32,
        cache_bytes=cache_bytes,
        prefix_store=prefix_store,
        speculative=SpeculativeConfig(mode="off"),
    )


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text", "falcon_h1"])
def test_checkpoints_go_to_the_disk_tier_and_come_back(family, family_dirs, tmp_path):
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint

    def store():
        return PrefixStore(tmp_path / "store", model_fingerprint(family_dirs[family]), 64 << 20)

    first = _hybrid_runner(family_dirs[family], prefix_store=store())
    prompt = _chat(first.tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    expected, _ = _run(first, prompt)
    saved = first.cache_stats()
    report = first.prefix_store.save(first.prefix_cache)
    assert report["saved_blocks"] == saved["blocks"]

    again = _hybrid_runner(family_dirs[family], prefix_store=store())
    report = again.prefix_store.restore(again.prefix_cache)
    assert report["indexed_blocks"] == saved["blocks"] and again.cache_stats()["bytes"] == 0
    out, cached = _run(again, prompt)  # resumed from the checkpoint before the last token
    assert cached == len(prompt) - 1 and out == expected
    assert again.cache_stats()["disk_tier"]["tokens_brought_back"] >= cached  # read back from its blocks


def test_checkpoint_bytes_count_against_the_cache_bound_and_leave_with_their_entry(family_dirs):
    runner = _hybrid_runner(family_dirs["qwen3_next"])
    tok = runner.tokenizer
    prompts = [tok.encode(f"topic {i}: " + "words and more words " * 12) for i in range(3)]
    for p in prompts:
        _run(runner, p, 2)
    stats = runner.cache_stats()
    assert stats["checkpoint_bytes"] > 0
    entry_bytes = sum(e.nbytes for e in runner.prefix_cache.entries())  # entries with their checkpoints
    assert stats["bytes"] == entry_bytes
    # A bound that holds about one entry: the others leave, their checkpoints with them.
    runner.prefix_cache.trim_to(entry_bytes // 3 + 1)
    after = runner.cache_stats()
    assert after["entries"] == 1 and after["bytes"] <= entry_bytes // 3 + 1
    assert after["checkpoint_bytes"] == sum(e.checkpoints.nbytes for e in runner.prefix_cache.entries())
    _, cached = _run(runner, prompts[-1], 2)  # the newest stayed, resumable
    assert cached == len(prompts[-1]) - 1


# -- through `mlxgw up` and real HTTP -------------------------------------------------------------
SERVED = ["qwen3_5", "gemma3_text", "lfm2"]  # nested args; sliding window; short convolutions


# Continuations that start with a space, spaces, a newline and a multi-byte character.
CONTINUATIONS = [" Paris", "    ", "\n", " caf\u00e9"]


@pytest.mark.parametrize("family", ORDERED_FAMILIES)
def test_a_continuations_text_is_the_decoding_of_its_tokens(family, family_dirs):
    """The worker's text of a continuation (what intake streams for a prompt, not a chat) equals
    the tokenizer's own decode of the ids, each run forced to start with a token of each kind."""
    from mlxgw.shared.protocol import SamplingParams
    from mlxgw.worker.process.build_mlx import build_mlx_runner
    from mlxgw.worker.text.textstream import TextStream, exact_text

    runner = build_mlx_runner(
        family_dirs[family], context_length=None, max_num_seqs=4, prefill_step_size=64, cache_bytes=0
    )
    tok = runner.tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    for text in CONTINUATIONS:
        first = tok.encode(text, add_special_tokens=False)[0]
        sampling = SamplingParams(temperature=0.0, logit_bias={first: 100.0})
        uid, _ = runner.insert(Row(prompt, 3, sampling))
        ids, stream, out = [], TextStream(exact_text(runner.new_detokenizer()), []), []
        while len(ids) < 3:
            for t in runner.step().tokens:
                if t.uid == uid:
                    ids.append(t.token)
                    out.append(stream.push(t.token))
        out.append(stream.finish())
        assert ids[0] == first
        assert "".join(out) == tok.decode(ids), (family, text, ids)


@pytest.fixture(scope="module")
def families_gateway(home, family_dirs):
    from helpers import start_gateway

    broken = home / "models" / "fam-broken"
    broken.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (broken / name).write_bytes((family_dirs["llama"] / name).read_bytes())
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture", "vocab_size": 8}))
    models = [
        {"name": f"fam-{f}", "preload": True, "max_num_seqs": 4, "cache": {"prefix_memory_mb": 64}} for f in SERVED
    ]
    # kv_bits from models.yaml (64-wide heads: quantization groups of 32 fit them).
    build_family_model("llama", home / "models" / "fam-kv8", home / "models" / "fam-llama", overrides=WIDE_HEADS)
    models.append(
        {"name": "fam-kv8", "source": "fam-kv8", "cache": {"kv_bits": 8, "kv_group_size": 32}, "max_num_seqs": 4}
    )
    config = {"manager": {"auto_discover": False}, "models": [*models, {"name": "fam-broken", "max_num_seqs": 4}]}
    gw = start_gateway(home, config, "families-gateway")
    yield gw
    gw.stop()


def _worker_cache(gw, name: str) -> dict:
    workers = [w for w in gw.model_status(name)["workers"] if w["state"] == "ready"]
    return (workers[0].get("stats") or {}).get("cache") or {}


@pytest.mark.parametrize("family", SERVED)
def test_a_served_family_reuses_the_shared_system_prompt_over_http(family, families_gateway):
    from helpers import openai_client, wait_for

    client = openai_client(families_gateway)
    system = {"role": "system", "content": SYSTEM}

    def ask(question: str):
        return client.chat.completions.create(
            model=f"fam-{family}",
            messages=[system, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )

    first, repeat, other = ask("Where is the scheduler?"), ask("Where is the scheduler?"), ask("Who owns it?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert repeat.choices[0].message.content == first.choices[0].message.content
    assert repeat.usage.prompt_tokens_details.cached_tokens == repeat.usage.prompt_tokens - 1
    assert other.usage.prompt_tokens_details.cached_tokens >= 40  # the system prompt's boundary
    wait_for(lambda: _worker_cache(families_gateway, f"fam-{family}").get("checkpoint_hits", 0) >= 2, 15)
    cache = _worker_cache(families_gateway, f"fam-{family}")
    assert cache["reused_tokens"] >= repeat.usage.prompt_tokens_details.cached_tokens and cache["checkpoints"] > 0


@pytest.mark.parametrize("family", SERVED)
def test_a_completion_over_http_is_the_decoding_of_its_tokens(family, families_gateway, family_dirs):
    """/v1/completions (streamed and not) and Ollama's raw /api/generate return the exact text."""
    from helpers import http, openai_client
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dirs[family])
    client, model = openai_client(families_gateway), f"fam-{family}"
    for text in CONTINUATIONS:
        first = tok.encode(text, add_special_tokens=False)[0]
        bias, want = {str(first): 100}, tok.decode([first] * 3)
        args = dict(model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logit_bias=bias)
        assert client.completions.create(**args).choices[0].text == want, (family, text)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
        assert streamed == want, (family, text)
        body = {"model": model, "prompt": "The capital of France is", "raw": True, "stream": False}
        body["options"] = {"num_predict": 3, "temperature": 0, "logit_bias": bias}
        status, _, answer = http(f"{families_gateway.url}/api/generate", "POST", body)
        assert status == 200 and answer["response"] == want, (family, text, answer)


def test_kv_bits_from_models_yaml_quantizes_the_served_models_kv(families_gateway):
    from helpers import openai_client, wait_for

    client = openai_client(families_gateway)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the scheduler?"}]
    answers = [
        client.chat.completions.create(model="fam-kv8", messages=messages, max_tokens=4, temperature=0)
        for _ in range(2)
    ]
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content
    assert answers[1].usage.prompt_tokens_details.cached_tokens == answers[1].usage.prompt_tokens - 1

    def stats() -> dict:
        workers = [w for w in families_gateway.model_status("fam-kv8")["workers"] if w["state"] == "ready"]
        return workers[0].get("stats") or {} if workers else {}

    wait_for(lambda: "kv_bits" in stats(), 15)
    # 2 layers x 1 KV head x 64 x 2 x (1 + 2 x 4 / 32) bytes: 8-bit KV of a float32 model.
    assert stats()["kv_bits"] == 8 and stats()["kv_bytes_per_token"] == 320


def test_a_model_that_cannot_load_fails_once_with_its_reason(families_gateway):
    from helpers import http, wait_for

    request = {"model": "fam-broken", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    code, _, body = http(f"{families_gateway.url}/v1/chat/completions", "POST", request)
    assert code == 503 and "no_such_architecture" in json.dumps(body)
    wait_for(lambda: families_gateway.model_status("fam-broken")["state"] == "failed", 30)
    status = families_gateway.model_status("fam-broken")
    assert status["loads"] == 1 and status["restarts"] == 0
    assert "cannot load" in status["last_error"] and "no_such_architecture" in status["last_error"]


def test_folders_mlx_lm_loads_serve_a_gemma3_multimodal_folder_and_a_quantized_qwen3_5(home, smollm2_dir):
    """Nested text_config args with weights under language_model, and a 4-bit folder of a
    nested-args family: both load, generate mlx-lm's tokens and reuse a repeat."""
    from helpers.family_models import build_gemma3_multimodal_folder, build_quantized_family_model

    folders = [
        build_gemma3_multimodal_folder(home / "models" / "fam-gemma3-vl", smollm2_dir),
        build_quantized_family_model("qwen3_5", home / "models" / "fam-qwen3_5-4bit", smollm2_dir),
    ]
    for folder in folders:
        runner = _hybrid_runner(folder)
        assert runner.vocab_size == 49152
        prompt = _chat(runner.tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
        out, _ = _run(runner, prompt)
        assert_greedy_equal(
            runner.model, prompt, _reference(runner.model, runner.tokenizer, prompt, TOKENS), out, folder.name
        )
        again, cached = _run(runner, prompt)
        assert again == out and cached == len(prompt) - 1
