"""POST /tokenize and POST /detokenize (vLLM's shapes) against a real `mlxgw up`: the tiny
model carries SmolLM2's real tokenizer and chat template."""

from __future__ import annotations

import pytest
from helpers import http, openai_client

TEXT = "Hello world, héllo wörld! 1234"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def post(gw, path: str, body: dict):
    return http(f"{gw.url}{path}", method="POST", body=body)


def test_prompt_tokens_are_the_models_own(tiny_gateway, smollm2_tokenizer):
    status, _, r = post(tiny_gateway, "/tokenize", {"model": "tiny", "prompt": TEXT})
    assert status == 200
    assert r["tokens"] == smollm2_tokenizer.encode(TEXT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0


def test_tokenize_detokenize_round_trip(tiny_gateway):
    _, _, r = post(tiny_gateway, "/tokenize", {"model": "tiny", "prompt": TEXT, "add_special_tokens": False})
    status, _, back = post(tiny_gateway, "/detokenize", {"model": "tiny", "tokens": r["tokens"]})
    assert status == 200 and back == {"prompt": TEXT}


def test_messages_count_equals_a_chat_requests_prompt_tokens(tiny_gateway):
    _, _, r = post(tiny_gateway, "/tokenize", {"model": "tiny", "messages": MESSAGES})
    chat = openai_client(tiny_gateway).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens == len(r["tokens"])


def test_messages_with_tools_count_like_the_chat_request(tiny_gateway):
    _, _, r = post(tiny_gateway, "/tokenize", {"model": "tiny-tools", "messages": MESSAGES, "tools": [TOOL]})
    chat = openai_client(tiny_gateway).chat.completions.create(
        model="tiny-tools", messages=MESSAGES, tools=[TOOL], max_tokens=1
    )
    assert r["count"] == chat.usage.prompt_tokens


def test_chat_template_applies_to_messages(tiny_gateway):
    _, _, r = post(tiny_gateway, "/tokenize", {"model": "tiny", "messages": MESSAGES})
    _, _, text = post(tiny_gateway, "/detokenize", {"model": "tiny", "tokens": r["tokens"]})
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text["prompt"]
    assert text["prompt"].endswith("<|im_start|>assistant\n")


def test_echo_engine_detokenizes_its_bytes(tiny_gateway):
    _, _, r = post(tiny_gateway, "/tokenize", {"model": "echo", "prompt": "héllo"})
    assert r["tokens"] == list("héllo".encode())
    _, _, back = post(tiny_gateway, "/detokenize", {"model": "echo", "tokens": r["tokens"]})
    assert back["prompt"] == "héllo"


BAD = [
    ("/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "nobody"}]}, 400, "messages"),
    ("/tokenize", {"model": "no-such-model", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": "tiny"}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": None}, 400, "tokens"),
    ("/tokenize", {"model": "tiny", "messages": MESSAGES, "tools": {"x": 1}}, 400, "tools"),
    ("/tokenize", {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": []}, 400, "chat_template_kwargs"),
    ("/tokenize", {"model": 5, "prompt": "a"}, 400, "model"),
    ("/tokenize", {"prompt": "a"}, 400, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{b[0]}-{b[1]}"[:50] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(tiny_gateway, path, body, status, param):
    pid = tiny_gateway.worker_pid("tiny")
    got, _, answer = post(tiny_gateway, path, body)
    assert got == status and answer["error"]["param"] == param
    assert tiny_gateway.worker_pid("tiny") == pid
