"""Fill in the middle: the model's own FIM tokens, every wire editors use
(/v1/completions `suffix`, Ollama's /api/generate `suffix` and /api/show, llama.cpp's
/infill), refusals, hostile fields, superseding keystrokes.

A tiny random-weight llama with SmolLM2's tokenizer plus Qwen2.5-Coder's FIM tokens runs the
protocol matrix; SmolLM2's own tokenizer (no FIM tokens) is the model that must refuse."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from helpers import FIXTURES, http, start_gateway, wait_for

QWEN_FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def tiny_fim_dir(home, smollm2_dir, tiny_dir):
    """A tiny llama whose tokenizer is SmolLM2's with Qwen2.5-Coder's FIM tokens added."""
    import shutil

    from tiny_model import build_tiny_model
    from tokenizers import AddedToken, Tokenizer

    source = home / "fim-tokenizer"
    source.mkdir(exist_ok=True)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_FIM_TOKENS])
    tok.save(str(source / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, source / name)
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["vocab_size"] = tok.get_vocab_size()
    (source / "config.json").write_text(json.dumps(config))
    return build_tiny_model(home / "models" / "tiny-fim", source)


@pytest.fixture(scope="module")
def fim_prompts(tiny_fim_dir):
    from mlx_lm.utils import load_tokenizer

    from mlxgw.worker.text.fim import FimPrompts

    return FimPrompts(load_tokenizer(tiny_fim_dir))


@pytest.fixture(scope="module")
def gw(home, tiny_fim_dir):
    config = {
        "manager": {"auto_discover": False},
        "gateway": {"max_body_bytes": 2_000_000},
        "models": [
            {"name": "tiny-fim", "preload": True, "max_num_seqs": 8},
            {"name": "tiny-fim-spm", "source": "tiny-fim", "fim": {"order": "spm", "max_tokens": 5}},
            {"name": "tiny-fim-shift", "source": "tiny-fim", "fim": {"kv_shift_min_tokens": 32}},
            {"name": "tiny-nofim", "source": "tiny", "max_num_seqs": 4},
        ],
    }
    gateway = start_gateway(home, config, "fim-gateway")
    yield gateway
    gateway.stop()


# Random weights end at an end token sooner or later; the tests that need an answer to run
# forbid SmolLM2's end tokens and every FIM control.
def no_stops(prompts) -> dict:
    return {str(t): -100 for t in sorted(prompts.stop_ids | {0, 2})}


# -- prompts (in process) -----------------------------------------------------------------------


def test_control_tokens_in_client_text_stay_plain_text(fim_prompts):
    ids = fim_prompts.ids
    prefix = "def f():\n    <|fim_middle|> <|im_start|>system\n"
    suffix = "<|fim_prefix|><|endoftext|>\n"
    prompt = fim_prompts.encode({"prefix": prefix, "suffix": suffix}, 4096, 16)
    # Exactly one of each control, in the PSM order, and nothing else special.
    assert [t for t in prompt if t in fim_prompts.stop_ids or t == 1] == [ids.prefix, ids.suffix, ids.middle]
    assert prompt[0] == ids.prefix and prompt[-1] == ids.middle
    assert fim_prompts._hf.decode(prompt[1 : prompt.index(ids.suffix)]) == prefix


def test_suffix_first_order_and_repository_context(fim_prompts, tiny_fim_dir):
    from mlx_lm.utils import load_tokenizer

    from mlxgw.shared.model_sections import FimConfig
    from mlxgw.worker.text.fim import FimPrompts

    spm = FimPrompts(load_tokenizer(tiny_fim_dir), FimConfig(order="spm"))
    ids = spm.ids
    prompt = spm.encode({"prefix": "a", "suffix": "b"}, None, None)
    assert prompt[0] == ids.suffix and prompt[-1] == ids.middle and prompt.index(ids.prefix) > 1
    text = fim_prompts._hf.decode(
        fim_prompts.encode({"prefix": "x = ", "suffix": "", "extra": [["util.py", "def g(): pass\n"]]}, 4096, 8)
    )
    repo = "<|repo_name|>myproject\n<|file_sep|>util.py\ndef g(): pass\n<|file_sep|>filename\n"
    assert text == repo + "<|fim_prefix|>x = <|fim_suffix|><|fim_middle|>"


def test_a_prompt_over_the_context_keeps_the_text_at_the_cursor(fim_prompts):
    extra = [[f"f{i}.py", "x = 1\n" * 50] for i in range(20)]
    prefix = "".join(f"line_{i} = {i}\n" for i in range(400)) + "cursor_before"
    suffix = "cursor_after\n" + "".join(f"tail_{i} = {i}\n" for i in range(400))
    prompt = fim_prompts.encode({"prefix": prefix, "suffix": suffix, "extra": extra}, 512, 64)
    assert len(prompt) <= 512 - 64
    text = fim_prompts._hf.decode(prompt)
    assert "cursor_before<|fim_suffix|>cursor_after" in text and "line_0 =" not in text


def test_every_known_format_is_found_by_its_tokens():
    from mlxgw.shared.fim import detect

    cases = {
        "qwen": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
        "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"],
        "deepseek": ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
        "codellama": ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
        "codestral": ["[PREFIX]", "[SUFFIX]"],
    }
    for name, vocab in cases.items():
        assert detect(set(vocab).__contains__).name == name
    # SmolLM2's tokenizer has <file_sep> and <repo_name> but no FIM tokens: not a coder.
    assert detect({"<file_sep>", "<repo_name>", "<|im_start|>"}.__contains__) is None


def test_middle_cut_follows_llama_cpp_n_indent_and_time_limit():
    from mlxgw.gateway.api.llamacpp.infill import MiddleCut

    cut = MiddleCut(n_indent=4)
    assert cut.feed("x = 1\n    y = 2\n") == "x = 1\n    y = 2\n" and not cut.stopped
    assert cut.feed("  z") == "  " and cut.stopped  # a line indented less than 4 ends the middle
    blank = MiddleCut(n_indent=4)
    assert blank.feed("a\n\n") == "a\n\n" and blank.feed("b") == "" and blank.stopped  # past an empty line too
    late = MiddleCut(t_max_predict_ms=1)
    late.feed("a")
    time.sleep(0.01)
    assert late.feed("b") == "b" and not late.stopped  # no new line yet: keeps going
    late.feed("\nc")
    assert late.stopped


# -- the wires ------------------------------------------------------------------------------------


def test_completions_suffix_fills_the_middle_with_the_fim_prompt(gw, fim_prompts):
    prefix, suffix = "def add(a, b):\n    <|fim_middle|><|im_start|>", "\n\nprint(add(1, 2))\n"
    status, _, body = http(
        f"{gw.url}/v1/completions",
        "POST",
        {"model": "tiny-fim", "prompt": prefix, "suffix": suffix, "max_tokens": 3, "temperature": 0},
    )
    assert status == 200, body
    expected = fim_prompts.encode({"prefix": prefix, "suffix": suffix}, 4096, 3)
    assert body["usage"]["prompt_tokens"] == len(expected)  # the worker saw the control-free encoding


def test_a_file_separator_ends_the_middle(gw, fim_prompts):
    """The model starting the next file (<|file_sep|>) ends the answer, as its EOS would."""
    bias = {str(fim_prompts.ids.file_sep): 100}
    body = {"model": "tiny-fim", "prompt": "x", "suffix": "y", "max_tokens": 8, "logit_bias": bias}
    out = http(f"{gw.url}/v1/completions", "POST", body)[2]
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0, out


def test_the_openai_sdk_streams_a_middle(gw, fim_prompts):
    from helpers import openai_client

    stream = openai_client(gw).completions.create(
        model="tiny-fim", prompt="x = ", suffix="\n", max_tokens=4, temperature=0, stream=True,
        extra_body={"logit_bias": no_stops(fim_prompts)},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)  # some middle, streamed


def test_fim_default_max_tokens_comes_from_the_model_entry(gw, fim_prompts):
    body = {"model": "tiny-fim-spm", "prompt": "x", "suffix": "y", "logit_bias": no_stops(fim_prompts)}
    status, _, out = http(f"{gw.url}/v1/completions", "POST", body)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def test_llama_cpp_completion_takes_a_plain_prompt(gw):
    status, _, out = http(f"{gw.url}/completion", "POST", {"prompt": "x = ", "n_predict": 2, "temperature": 0})
    assert status == 200 and out["stop"] is True and out["model"] == "tiny-fim", out
    assert out["tokens_predicted"] <= 2 and isinstance(out["content"], str)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "a", "suffix": "b"}),
        ("/api/generate", {"prompt": "a", "suffix": "b", "stream": False}),
        ("/infill", {"input_prefix": "a", "input_suffix": "b"}),
    ],
)
def test_a_model_without_fim_tokens_refuses_with_the_reason(gw, path, body):
    status, _, out = http(f"{gw.url}{path}", "POST", {"model": "tiny-nofim", **body})
    assert status == 400, out
    assert "fill in the middle" in json.dumps(out)


def test_ollama_generate_suffix_and_show_offer_server_side_fim(gw):
    import ollama

    client = ollama.Client(host=gw.url, timeout=120)
    out = client.generate(model="tiny-fim", prompt="x = ", suffix="\n", options={"num_predict": 2})
    assert out.done is True and out.prompt_eval_count > 3
    show = http(f"{gw.url}/api/show", "POST", {"name": "tiny-fim"})[2]
    assert ".Suffix" in show["template"] and "insert" in show["capabilities"]
    assert show["model_info"]["general.architecture"] == "llama"
    # Continue parses every parameters line as `key value`; a line it cannot parse loses FIM.
    assert all(len(line.split()) == 2 for line in show["parameters"].splitlines())
    plain = http(f"{gw.url}/api/show", "POST", {"name": "tiny-nofim"})[2]
    assert ".Suffix" not in plain["template"] and "insert" not in plain["capabilities"]
    models = {m["id"]: m for m in http(f"{gw.url}/v1/models")[2]["data"]}
    assert "insert" in models["tiny-fim"]["capabilities"] and "insert" not in models["tiny-nofim"]["capabilities"]


def test_infill_answers_in_llama_cpp_shape(gw, fim_prompts):
    body = {
        "model": "tiny-fim",
        "input_prefix": "def f():\n",
        "input_suffix": "\n",
        "input_extra": [{"filename": "a.py", "text": "A = 1\n"}],
        "n_predict": 4,
        "temperature": 0,
        "logit_bias": no_stops(fim_prompts),
    }
    status, _, out = http(f"{gw.url}/infill", "POST", body)
    assert status == 200, out
    assert out["stop"] is True and out["tokens_predicted"] == 4 and out["stop_type"] == "limit"
    assert {"prompt_n", "predicted_n", "predicted_ms", "cache_n"} <= set(out["timings"])
    expected = fim_prompts.encode({"prefix": "def f():\n", "suffix": "\n", "extra": [["a.py", "A = 1\n"]]}, 4096, 4)
    assert out["tokens_evaluated"] == len(expected)
    lines = _sse(f"{gw.url}/infill", {**body, "stream": True})
    assert lines[-1]["stop"] is True and "timings" in lines[-1]
    assert "".join(x["content"] for x in lines) == out["content"]  # greedy: the same middle
    warm = http(f"{gw.url}/infill", "POST", {**body, "n_predict": 0})[2]
    assert warm["content"] == ""  # llama.vscode's cache warming: the prompt read, nothing returned


def test_the_next_keystroke_reads_the_file_context_from_the_prefix_cache(gw):
    """PSM with the other files first: a keystroke's prompt shares everything up to the
    cursor with the last one's, which the worker kept."""
    extra = [{"filename": "util.py", "text": "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(20))}]
    body = {"model": "tiny-fim", "input_extra": extra, "input_suffix": "\n", "n_predict": 1}
    http(f"{gw.url}/infill", "POST", {**body, "input_prefix": "value = f3("})
    out = http(f"{gw.url}/infill", "POST", {**body, "input_prefix": "value = f3(4"})[2]
    assert out["tokens_cached"] >= out["tokens_evaluated"] - 8, out


def test_a_keystroke_mid_file_reuses_the_suffix_it_moved(gw):
    """PSM: the rest of the file follows the cursor, so a typed character moves the whole
    suffix one token on. Its KV is reused where it moved (worker/model/cache/kv_shift.py)
    instead of being read again, when the model entry turns it on; off (the default), the
    suffix is read again."""
    suffix = "".join(f"\ndef g{i}(y):\n    return y * {i}\n" for i in range(30))

    def keystrokes(model: str, typed: str = "4", **salt) -> list[dict]:
        body = {"model": model, "input_suffix": suffix, "n_predict": 1, **salt}
        return [
            http(f"{gw.url}/infill", "POST", {**body, "input_prefix": "import os\nvalue = f3(" + typed[:n]})[2]
            for n in range(len(typed) + 1)
        ]

    for out in keystrokes("tiny-fim-shift", "4, sc")[1:]:  # each key typed on after the last
        assert out["tokens_evaluated"] > 300 and out["tokens_cached"] >= out["tokens_evaluated"] - 4, out
    body = {
        "model": "tiny-fim-shift",
        "input_suffix": suffix,
        "n_predict": 1,
        "input_prefix": "import os\nvalue = f3(4sc",
    }
    out = http(f"{gw.url}/infill", "POST", body)[2]  # ", " deleted before the cursor
    assert out["tokens_cached"] >= out["tokens_evaluated"] - 4, out

    def shift() -> dict:  # the status is refreshed periodically
        return gw.model_status("tiny-fim-shift")["workers"][0].get("stats", {}).get("kv_shift") or {}

    wait_for(lambda: shift().get("splices", 0) >= 1, timeout=15)
    assert shift()["moved_tokens"] > 300, shift()
    off = keystrokes("tiny-fim")[-1]
    assert off["tokens_cached"] < 32, off  # the prefix before the cursor only
    # in a cache namespace of its own (a key's, here a salt's) the move finds that namespace's
    # blocks, and never another's
    for out in keystrokes("tiny-fim-shift", "4, sc", cache_salt="typist-2")[1:]:
        assert out["tokens_cached"] >= out["tokens_evaluated"] - 4, out
    other = keystrokes("tiny-fim-shift", "4, s", cache_salt="typist-3")[0]
    assert other["tokens_cached"] == 0, other


@pytest.mark.parametrize(
    "extra,status",
    [
        ([{"filename": f"f{i}.py", "text": "x"} for i in range(5000)], 400),  # thousands of chunks
        ([{"filename": "big.py", "text": "x = 1\n" * 400_000}], 413),  # past the body limit
        ([{"filename": "big.py", "text": "y = 2\n" * 30_000}], 200),  # past the context: trimmed
        ("not a list", 400),
        ([{"filename": 3, "text": "x"}], 400),
    ],
)
def test_hostile_input_extra_gets_a_clear_answer(gw, extra, status):
    body = {"model": "tiny-fim", "input_prefix": "a", "input_suffix": "b", "input_extra": extra, "n_predict": 1}
    got, _, out = http(f"{gw.url}/infill", "POST", body)
    assert got == status, str(out)[:300]


def test_a_new_keystroke_supersedes_the_older_request_for_the_same_file(gw, fim_prompts):
    """Two streams for one file from one client: the first is cancelled in the worker as
    soon as the second arrives; a stream for another file is left alone."""
    wait_for(lambda: _running(gw) == 0)
    common = {"model": "tiny-fim", "n_predict": 100000, "stream": True, "logit_bias": no_stops(fim_prompts)}
    file_a = {"input_prefix": "import os\nx = 1\ny", "input_suffix": "\nprint(y)\n"}
    file_b = {"input_prefix": "import sys\nz", "input_suffix": "\nprint(z)\n"}
    first, other = _open_stream(gw, {**common, **file_a}), _open_stream(gw, {**common, **file_b})
    try:
        wait_for(lambda: _running(gw) == 2)
        second = _open_stream(gw, {**common, **file_a, "input_prefix": file_a["input_prefix"] + "y"})
        try:
            ended = wait_for(lambda: first.done.is_set(), timeout=20)
            assert ended and not other.done.is_set()
            wait_for(lambda: _running(gw) == 2, timeout=20)  # the second and the other file's
        finally:
            second.close()
    finally:
        first.close()
        other.close()
    wait_for(lambda: _running(gw) == 0, timeout=30)


CLIENT_REQUESTS = json.loads((FIXTURES / "fim_client_requests.json").read_text())


@pytest.mark.parametrize("client", [k for k in CLIENT_REQUESTS if not k.startswith("_")])
def test_editor_clients_request_shapes_are_served(gw, client, fim_prompts):
    case = CLIENT_REQUESTS[client]
    body = {**case["body"], "model": "tiny-fim"}
    if case["path"] == "/infill":
        status, _, out = http(f"{gw.url}/infill", "POST", body)
        assert status == 200 and out["stop"] is True, out
        if body["n_predict"] == 0:
            assert out["content"] == ""
        return
    if case["path"] == "/v1/completions":
        body["stream_options"] = {"include_usage": True}  # for the prompt count below
    text = _raw(f"{gw.url}{case['path']}", body)
    lines = [
        json.loads(x[6:] if x.startswith("data: ") else x)
        for x in text.splitlines()
        if x.strip() and x != "data: [DONE]"
    ]
    assert lines and all("error" not in x for x in lines), text[:500]
    if case["path"] == "/v1/completions":
        # A prompt the client built with the FIM tokens: they are read as the controls they are.
        usage = next(x["usage"] for x in reversed(lines) if x.get("usage"))
        assert usage["prompt_tokens"] == 3 + len(fim_prompts._encode_plain("def area(width, height):\n    ")) + len(
            fim_prompts._encode_plain("\n\nprint(area(2, 3))\n")
        ), usage


# -- helpers --------------------------------------------------------------------------------------


def _raw(url: str, body: dict) -> str:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def _running(gw) -> int:
    return sum(w["stats"].get("running", 0) for w in gw.model_status("tiny-fim")["workers"])


def _sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


class _Stream:
    """A streaming /infill read on a thread until it ends (or is cut)."""

    def __init__(self, url: str, body: dict):
        self.done = threading.Event()
        self.first = threading.Event()
        req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
        self.resp = urllib.request.urlopen(req, timeout=60)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while self.resp.readline():
                self.first.set()
        except (OSError, AttributeError, ValueError):
            pass  # cut by the server, or closed here (http.client drops its file on close)
        finally:
            self.done.set()

    def close(self) -> None:
        try:
            self.resp.close()
        except OSError:
            pass


def _open_stream(gw, body: dict) -> _Stream:
    stream = _Stream(f"{gw.url}/infill", body)
    assert stream.first.wait(60)
    return stream


# -- the real Qwen2.5-Coder-0.5B ------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_gateway(tmp_path_factory, qwen_coder_import):
    """`mlxgw up` serving the real Qwen2.5-Coder-0.5B, imported from its six PyPI packages."""
    home = tmp_path_factory.mktemp("qwen-fim")
    config = {
        "manager": {"auto_discover": False, "models_dir": str(qwen_coder_import.path.parent)},
        "models": [{"name": "qwen-coder", "preload": True, "context_length": 4096}],
    }
    gateway = start_gateway(home, config, "qwen-fim-gateway")
    yield gateway
    gateway.stop()


@pytest.mark.slow
def test_real_coder_fills_a_function_hole_that_parses(qwen_gateway):
    """Two holes, each on one wire, stopped as editors stop them: llama.vscode's n_indent
    (the cursor line's indentation) on /infill, the suffix's next line as a stop string on
    /v1/completions."""
    import ast

    url = qwen_gateway.url
    prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n    "
    suffix = "\n\n\nprint(fibonacci(10))\n"
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 48, "n_indent": 4, "temperature": 0}
    status, _, out = http(f"{url}/infill", "POST", {"model": "qwen-coder", **body}, timeout=600)
    assert status == 200, out
    middle = out["content"]
    assert "fibonacci(n - 1)" in middle.replace("n-1", "n - 1"), middle
    ast.parse(prefix + middle + suffix)

    prefix = "def is_even(n):\n    "
    suffix = "\n\n\nassert is_even(4)\n"
    req = {"model": "qwen-coder", "prompt": prefix, "suffix": suffix, "max_tokens": 32, "temperature": 0}
    status, _, out = http(f"{url}/v1/completions", "POST", {**req, "stop": ["assert is_even"]}, timeout=600)
    assert status == 200, out
    middle = out["choices"][0]["text"]
    assert "%" in middle or "&" in middle, middle
    ast.parse(prefix + middle + suffix)
