"""The Ollama-compatible API through the official `ollama` Python client against a real
`mlxgw up`: the tiny model (protocol, constrained decoding), the echo
engine (exact output: tool calls, thinking), the real MiniLM encoder (embeddings)."""

from __future__ import annotations

import base64
import datetime
import io
import json
import time

import jsonschema
import ollama
import psutil
import pytest
import yaml
from helpers import http, start_gateway, wait_for

from mlxgw.gateway.access.keys import hash_key

KEY = "sk-ollama-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "tiny", "preload": True, "chat": {"tool_parser": "hermes"}},
        {"name": "tiny-unload", "source": "tiny"},
        # Idle models leave after a second, unless keep_alive holds them.
        {"name": "echo", "engine": "echo", "chat": {"tool_parser": "hermes", "reasoning_parser": "think"}},
        {"name": "echo-idle", "engine": "echo", "idle_unload_s": 1},
        {"name": "minilm-l6", "kind": "embedding"},
        {"name": "tiny-short", "source": "tiny", "context_length": 64, "max_tokens_policy": "reject"},
    ],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gw(home, tiny_dir, minilm_dir):
    gw = start_gateway(home, CONFIG, "ollama-gateway")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def keyed_gw(home):
    """Keys on, the echo engine only (no weights to load)."""
    keys = home / "ollama-keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "olly", "sha256": hash_key(KEY)}]}))
    config = {"manager": {"auto_discover": False}, "models": [{"name": "echo", "engine": "echo"}]}
    gw = start_gateway(home, config, "ollama-keyed-gateway", extra_args=("--keys", str(keys)))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gw) -> ollama.Client:
    return ollama.Client(host=gw.url, timeout=120)


def post(gw, path: str, body: dict):
    return http(f"{gw.url}{path}", method="POST", body=body)


def test_chat_answers_with_a_message_and_ollama_counters(client):
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 5})
    assert r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and isinstance(r.message.content, str)
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= 5
    assert r.total_duration > 0


def test_chat_streams_ndjson_by_default(gw):
    body = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
    status, headers, text = post(gw, "/api/chat", body)
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in text.splitlines()]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert "".join(line["message"]["content"] for line in lines) == "hello there"
    assert lines[-1]["eval_count"] == len("hello there")


def test_chat_stream_through_the_client_assembles_the_echo(client):
    parts = list(client.chat(model="echo", messages=[{"role": "user", "content": "abc def"}], stream=True))
    assert "".join(p.message.content for p in parts) == "abc def"
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_generate_streaming_and_not(client):
    whole = client.generate(model="echo", prompt="one two three", stream=False)
    assert whole.response == "one two three" and whole.done
    parts = list(client.generate(model="echo", prompt="one two three", stream=True))
    assert "".join(p.response for p in parts) == "one two three"


def test_generate_honours_options(client):
    r = client.generate(model="tiny", prompt="Count", options={"num_predict": 3, "temperature": 0, "seed": 1})
    assert r.eval_count <= 3
    again = client.generate(model="tiny", prompt="Count", options={"num_predict": 3, "temperature": 0, "seed": 1})
    assert again.response == r.response


def test_stop_option_ends_the_answer(client):
    r = client.generate(model="echo", prompt="alpha STOP beta", options={"stop": ["STOP"]}, stream=False)
    assert r.response == "alpha "


def test_format_schema_is_enforced(client):
    for seed in range(3):
        r = client.chat(
            model="tiny",
            messages=[{"role": "user", "content": "A person"}],
            format=PERSON,
            options={"num_predict": 200, "temperature": 1.0, "seed": seed},
        )
        jsonschema.validate(json.loads(r.message.content), PERSON)


def test_format_json_gives_an_object(client):
    r = client.generate(model="tiny", prompt="x", format="json", options={"num_predict": 300, "seed": 3})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)
    else:  # an unbounded object from random weights may run out of tokens; it must still be a JSON prefix
        assert r.response.lstrip().startswith("{")


def test_tool_calls_come_back_with_object_arguments(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = client.chat(model="echo", messages=[{"role": "user", "content": call}], tools=[WEATHER_TOOL])
    (tc,) = r.message.tool_calls
    assert tc.function.name == "get_weather" and tc.function.arguments == {"city": "Paris"}


def test_tool_results_go_back_to_the_model(client):
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    r = client.chat(model="tiny", messages=history, tools=[WEATHER_TOOL], options={"num_predict": 4})
    assert r.done and r.prompt_eval_count > 20


def test_thinking_is_its_own_field(client):
    r = client.chat(model="echo", messages=[{"role": "user", "content": "<think>hmm</think>Yes."}], think=True)
    assert r.message.thinking == "hmm" and r.message.content == "Yes."


def test_embed_returns_one_vector_per_input(client):
    r = client.embed(model="minilm-l6", input=["a cat", "a dog"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 384
    assert r.prompt_eval_count > 0
    single = client.embed(model="minilm-l6", input="a cat")
    assert single.embeddings[0] == pytest.approx(r.embeddings[0], abs=1e-5)


def test_older_embeddings_route(client):
    r = client.embeddings(model="minilm-l6", prompt="a cat")
    assert len(r.embedding) == 384


def test_tags_lists_every_model(client):
    names = {m.model for m in client.list().models}
    assert {"tiny", "tiny-unload", "echo", "minilm-l6"} <= names


def test_ps_lists_loaded_models(client):
    client.generate(model="tiny", prompt="x", options={"num_predict": 1})
    running = {m.model: m for m in client.ps().models}
    assert "tiny" in running and running["tiny"].size > 0


def test_show_describes_the_model(client):
    r = client.show("tiny")
    assert "completion" in r.capabilities and "tools" in r.capabilities
    assert "im_start" in r.template
    assert r.details.family == "llama"
    assert "embedding" in client.show("minilm-l6").capabilities


def test_tag_latest_names_the_model(client):
    r = client.generate(model="echo:latest", prompt="ok")
    assert r.response == "ok"


def test_version(gw):
    status, _, body = http(f"{gw.url}/api/version")
    assert status == 200 and body["version"]


def test_keep_alive_0_unloads_after_the_request(gw, client):
    client.generate(model="tiny-unload", prompt="x", options={"num_predict": 2})
    pid = gw.worker_pid("tiny-unload")
    r = client.generate(model="tiny-unload", prompt="x", options={"num_predict": 2}, keep_alive=0)
    assert r.done
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 60)
    wait_for(lambda: not gw.model_status("tiny-unload")["loaded"], 30)
    assert "tiny-unload" not in {m.model for m in client.ps().models}


def test_idle_model_leaves_without_keep_alive(client, gw):
    client.generate(model="echo-idle", prompt="x")
    wait_for(lambda: not gw.model_status("echo-idle")["loaded"], 30)


def test_a_request_while_the_model_drains_gets_a_fresh_worker(client, gw):
    """The next request right after keep_alive 0 waits for the old process to exit; its exit
    is not taken for a crash of the new one (no restart, no orphaned worker)."""
    for i in range(4):
        client.generate(model="echo-idle", prompt="x", keep_alive=0)
        time.sleep(0.05 * i)  # land in the unload at different moments
        assert client.generate(model="echo-idle", prompt="again").response == "again"
    time.sleep(2)
    status = gw.model_status("echo-idle")
    assert status["restarts"] == 0 and all(w["local"] for w in status["workers"])


def test_keep_alive_duration_holds_the_model_past_its_idle_time(client, gw):
    client.generate(model="echo-idle", prompt="x", keep_alive="2h")
    (held,) = [m for m in client.ps().models if m.model == "echo-idle"]
    left = held.expires_at - datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(minutes=110) < left <= datetime.timedelta(hours=2, minutes=1)
    time.sleep(4)  # four idle ticks past its idle_unload_s
    assert gw.model_status("echo-idle")["loaded"]
    client.generate(model="echo-idle", prompt="x", keep_alive="1s")  # the latest keep_alive wins
    wait_for(lambda: not gw.model_status("echo-idle")["loaded"], 30)


def test_load_only_request_loads_the_model(client, gw):
    r = client.generate(model="tiny-unload", keep_alive="1m")
    assert r.done and r.done_reason == "load"
    assert gw.model_status("tiny-unload")["loaded"]
    r = client.generate(model="tiny-unload", keep_alive=0)
    assert r.done_reason == "unload"
    assert not gw.model_status("tiny-unload")["loaded"]


# -- errors in Ollama's shape -------------------------------------------------------------------------

BAD = [
    ({"keep_alive": "5 minutes"}, 400, "keep_alive"),
    ({"keep_alive": True}, 400, "keep_alive"),
    ({"keep_alive": "1x"}, 400, "keep_alive"),
    ({"options": {"temperature": "hot"}}, 400, "temperature"),
    ({"options": {"num_predict": "many"}}, 400, "num_predict"),
    ({"options": {"num_predict": 0}}, 400, "num_predict"),
    ({"options": {"top_p": 3}}, 400, "top_p"),
    ({"options": {"seed": 2**64}}, 400, "seed"),
    ({"options": {"num_ctx": 0}}, 400, "num_ctx"),
    ({"options": {"stop": 5}}, 400, "stop"),
    ({"options": "fast"}, 400, "options"),
    ({"format": "xml"}, 400, "format"),
    ({"think": "very"}, 400, "think"),
    ({"stream": "yes"}, 400, "stream"),
    ({"tools": {"x": 1}}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]}, 400, "images"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
    # Bad types anywhere in the decoded body (ollama_fields): a 400 naming the field, never a 500.
    ({"options": {"top_k": "x"}}, 400, "top_k"),
    ({"options": {"repeat_penalty": "x"}}, 400, "repeat_penalty"),
    ({"options": {"num_ctx": True}}, 400, "num_ctx"),
    ({"options": {"seed": 1.5}}, 400, "seed"),
    ({"options": {"logit_bias": []}}, 400, "logit_bias"),
    ({"model": 5}, 400, "model"),
    ({"template": "{{ .Prompt }}"}, 400, "template"),
]


@pytest.mark.parametrize(("extra", "status", "mention"), BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_input_is_an_ollama_error(gw, extra, status, mention):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False, **extra}
    got, _, answer = post(gw, "/api/chat", body)
    assert got == status and set(answer) == {"error"} and mention in answer["error"]


def test_client_raises_response_error_for_unknown_model(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404


def test_a_refusal_before_the_first_line_is_an_http_error_even_when_streaming(gw):
    body = {"model": "tiny-short", "prompt": "word " * 200, "options": {"num_predict": 10}}
    got, headers, answer = post(gw, "/api/generate", body)
    assert got == 400 and set(answer) == {"error"} and headers["content-type"].startswith("application/json")


def test_generate_streams_thinking_separately(client):
    parts = list(client.generate(model="echo", prompt="<think>hmm</think>Yes.", think=True, stream=True))
    assert "".join(p.thinking or "" for p in parts) == "hmm"
    assert "".join(p.response for p in parts) == "Yes."


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/api/show", {"model": "no-such-model"}, 404),
        ("/api/show", {}, 400),
        ("/api/embed", {"model": "minilm-l6", "input": "x", "keep_alive": "soon"}, 400),
        ("/api/embed", {"model": "minilm-l6", "input": "x", "options": {"temperature": "hot"}}, 400),
        ("/api/embed", {"model": "tiny", "input": "x"}, 400),
        ("/api/embeddings", {"model": "minilm-l6", "prompt": 5}, 400),
        ("/api/chat", {"model": "minilm-l6", "messages": [{"role": "user", "content": "x"}]}, 400),
        ("/api/generate", {"model": "tiny", "prompt": "x", "options": {"top_k": -1}}, 400),
        ("/api/generate", {"model": "tiny", "prompt": "x", "keep_alive": [5]}, 400),
        ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400),
        ("/api/generate", {"model": "tiny", "prompt": "x", "raw": True, "system": "s"}, 400),
    ],
)
def test_bad_input_on_every_route_is_an_ollama_error(gw, path, body, status):
    got, _, answer = post(gw, path, body)
    assert got == status and set(answer) == {"error"} and answer["error"]


STRUCT_REFUSALS = [
    ("/api/generate", {"model": "tiny", "prompt": 5}, "'prompt' must be a string, got int"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "raw": "yes"}, "'raw' must be true or false, got str"),
    ("/api/generate", {"model": "tiny", "system": ["s"]}, "'system' must be a string, got list"),
    ("/api/generate", {"model": "tiny", "options": {"repeat_penalty": 11}}, "'repeat_penalty' must be at most 10"),
    ("/api/chat", {"model": "tiny", "options": {"top_k": "x"}}, "'top_k' must be an integer, got str"),
    ("/api/chat", {"messages": []}, "missing required parameter: 'model'"),
    ("/api/show", {"name": 5}, "'name' must be a string, got int"),
    ("/api/embed", {"model": "minilm-l6", "input": "x", "dimensions": 0}, "'dimensions' must be at least 1, got 0"),
    ("/api/embed", {"model": "minilm-l6", "input": "x", "truncate": "no"}, "'truncate' must be true or false, got str"),
    ("/api/embeddings", {"model": "minilm-l6", "prompt": "x", "options": []}, "'options' must be an object, got list"),
]


@pytest.mark.parametrize(
    ("path", "body", "message"), STRUCT_REFUSALS, ids=[f"{r[0]} {list(r[1])[-1]}" for r in STRUCT_REFUSALS]
)
def test_a_bad_type_is_a_400_naming_the_field_in_ollamas_shape(gw, path, body, message):
    got, _, answer = post(gw, path, {"stream": False, **body})
    assert got == 400 and set(answer) == {"error"} and message in answer["error"], answer


def test_repeat_penalty_is_read_as_repetition_penalty():
    from mlxgw.gateway.api.ollama.fields import OllamaOptions
    from mlxgw.gateway.pipeline.fields import decode_fields

    assert decode_fields({"repeat_penalty": 1.3}, OllamaOptions).repetition_penalty == 1.3
    assert decode_fields({"repetition_penalty": 1.2}, OllamaOptions).repetition_penalty == 1.2


def test_bad_embed_input_is_a_400(gw):
    got, _, answer = post(gw, "/api/embed", {"model": "minilm-l6", "input": []})
    assert got == 400 and "input" in answer["error"]


def test_keys_apply_as_bearer_tokens(keyed_gw):
    r = ollama.Client(host=keyed_gw.url, headers=AUTH).chat(model="echo", messages=[{"role": "user", "content": "k"}])
    assert r.message.content == "k"
    got, _, answer = http(f"{keyed_gw.url}/api/tags")
    assert got == 401 and set(answer) == {"error"}
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=keyed_gw.url, headers={"Authorization": "Bearer wrong"}).list()
    assert e.value.status_code == 401


def test_worker_lives_after_bad_input(gw, client):
    pid = gw.worker_pid("tiny")
    post(gw, "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "format": {"type": 7}})
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "x"}], options={"num_predict": 1})
    assert r.done and gw.worker_pid("tiny") == pid


# -- images for vision models ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_gw(home, tiny_vision_dir):
    config = {"manager": {"auto_discover": False}, "models": [{"name": "tiny-vision", "kind": "vision"}]}
    gw = start_gateway(home, config, "ollama-vision-gateway")
    yield gw
    gw.stop()


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_images_reach_a_vision_model(vision_gw):
    client = ollama.Client(host=vision_gw.url, timeout=120)
    ask = {"role": "user", "content": "What is in this image?"}
    text_only = client.chat(model="tiny-vision", messages=[ask], options={"num_predict": 2})
    with_image = client.chat(model="tiny-vision", messages=[{**ask, "images": [_png()]}], options={"num_predict": 2})
    # the image became vision tokens in the prompt: start, end and at least one patch token
    assert with_image.prompt_eval_count >= text_only.prompt_eval_count + 3
    r = client.generate(model="tiny-vision", prompt="Describe", images=[_png()], options={"num_predict": 2})
    assert r.prompt_eval_count >= text_only.prompt_eval_count
    (worker,) = vision_gw.model_status("tiny-vision")["workers"]
    wait_for(lambda: vision_gw.model_status("tiny-vision")["workers"][0]["stats"].get("images_seen") == 2, 10)


def test_an_image_that_is_not_an_image_is_a_400(vision_gw):
    body = {"model": "tiny-vision", "stream": False, "prompt": "x", "images": [base64.b64encode(b"text").decode()]}
    got, _, answer = post(vision_gw, "/api/generate", body)
    assert got == 400 and "not a PNG" in answer["error"]
