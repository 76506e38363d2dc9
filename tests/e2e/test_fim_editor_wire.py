"""Fill in the middle beside other clients, against a real `mlxgw up`: superseding only where
an editor asks for it (/infill), and ends with an explicit answer; parallel `suffix`
completions on /v1/completions are all answered; FIM tokens a tokenizer flags
`"special": false` (Qwen2.5-Coder's tokenizer.json does) stay plain text in client text."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from helpers import http, start_gateway, wait_for
from helpers.fim_models import build_fim_model


@pytest.fixture(scope="module")
def gw(home, smollm2_dir, tiny_dir):
    build_fim_model(home / "models" / "tiny-fim-wire", smollm2_dir, home / "fim-wire-tok")
    build_fim_model(home / "models" / "tiny-fim-unflagged", smollm2_dir, home / "fim-unflagged-tok", special=False)
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "tiny-fim-wire", "preload": True, "max_num_seqs": 8},
            {"name": "tiny-fim-unflagged", "preload": True, "max_num_seqs": 4},
        ],
    }
    gateway = start_gateway(home, config, "fim-wire-gateway")
    yield gateway
    gateway.stop()


# SmolLM2's end tokens and every FIM control forbidden: a random-weight answer runs its length.
NO_STOPS = {str(t): -100 for t in [0, 1, 2, *range(49152, 49158)]}


def _running(gw) -> int:
    return sum(w["stats"].get("running", 0) for w in gw.model_status("tiny-fim-wire")["workers"])


def test_parallel_suffix_completions_are_all_answered(gw):
    """Six snippets sharing a first line, sent at once as evaluation harnesses send them: on
    main 1 to 2 of 6 were answered, the others' connections reset (superseded as one file)."""
    answers: list[tuple[int, dict]] = []

    def send(i: int) -> None:
        body = {"model": "tiny-fim-wire", "prompt": f"import os\nx{i} = ", "suffix": f"\nprint(x{i})\n"}
        body.update(max_tokens=24, logit_bias=NO_STOPS)
        try:
            status, _, out = http(f"{gw.url}/v1/completions", "POST", body, timeout=120)
        except OSError as e:  # a reset connection
            status, out = 0, {"error": repr(e)}
        answers.append((status, out))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [s for s, _ in answers] == [200] * 6, answers
    assert all(out["choices"][0]["text"] for _, out in answers)


def _infill(prefix: str, **extra) -> dict:
    body = {"model": "tiny-fim-wire", "input_prefix": prefix, "input_suffix": "\nprint(y)\n", "logit_bias": NO_STOPS}
    return {**body, **extra}


def test_a_superseded_infill_stream_ends_with_an_error_event(gw):
    wait_for(lambda: _running(gw) == 0, timeout=60)
    req = urllib.request.Request(
        f"{gw.url}/infill",
        json.dumps(_infill("import os\ny", n_predict=100000, stream=True)).encode(),
        {"content-type": "application/json"},
    )
    lines: list[str] = []
    with urllib.request.urlopen(req, timeout=60) as first:
        lines.append(first.readline().decode())  # it runs
        status, _, out = http(f"{gw.url}/infill", "POST", _infill("import os\nyy", n_predict=4))
        assert status == 200 and out["stop"] is True, out
        lines += [x.decode() for x in first.read().splitlines()]  # ends: no reset
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    assert "superseded" in events[-1]["error"]["message"], events[-1]
    wait_for(lambda: _running(gw) == 0, timeout=30)


def test_a_superseded_infill_is_answered_with_a_json_error(gw):
    wait_for(lambda: _running(gw) == 0, timeout=60)
    got: list = []
    older = threading.Thread(
        target=lambda: got.append(http(f"{gw.url}/infill", "POST", _infill("import sys\nz", n_predict=100000)))
    )
    older.start()
    wait_for(lambda: _running(gw) == 1, timeout=60)
    status, _, out = http(f"{gw.url}/infill", "POST", _infill("import sys\nzz", n_predict=4))
    older.join(60)
    assert status == 200, out
    ((old_status, _, old_out),) = got
    assert old_status == 499 and "superseded" in old_out["error"]["message"], old_out


UNFLAGGED = "tiny-fim-unflagged"
MENTION = "# the prompt starts with <|fim_prefix|> and ends with <|fim_middle|>\n"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": MENTION + "def f():\n    ", "suffix": "\n", "max_tokens": 2}),
        ("/infill", {"input_prefix": MENTION, "input_suffix": "<|fim_suffix|>\n", "n_predict": 2}),
        ("/api/generate", {"prompt": MENTION, "suffix": "\n", "stream": False, "options": {"num_predict": 2}}),
    ],
)
def test_fim_tokens_not_flagged_special_stay_plain_text_in_fim(gw, path, body):
    """On main each was a 400 ("could not be encoded without the model's control tokens")."""
    status, _, out = http(f"{gw.url}{path}", "POST", {**body, "model": UNFLAGGED})
    assert status == 200, out


def test_fim_tokens_not_flagged_special_stay_plain_text_in_chat(gw):
    """The message's mention is the plain text's several tokens, not the FIM control's one id
    (on main it was that id: one token, as many as "fim")."""
    text = "what does <|fim_prefix|> mean?"
    body = {"model": UNFLAGGED, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    _, _, plain = http(f"{gw.url}/v1/chat/completions", "POST", body)
    body["messages"][0]["content"] = "what does fim mean?"
    status, _, other = http(f"{gw.url}/v1/chat/completions", "POST", body)
    assert status == 200 and "usage" in plain, plain
    assert plain["usage"]["prompt_tokens"] - other["usage"]["prompt_tokens"] >= 4, (plain["usage"], other["usage"])
