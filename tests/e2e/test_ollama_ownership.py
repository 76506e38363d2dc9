"""Ollama model management between the members of a team, on a real `mlxgw up` with keys:
whose files a delete removes, what a FROM may start from, what a created model is (its
template, its Modelfile), and what a kill or a delete in the middle of work leaves.

`private` serves from a folder in the models directory; the `manager` key may manage only
`team-*` models, so `private` is not one it may use."""

from __future__ import annotations

import json
import shutil
import threading
import time

import ollama
import pytest
import yaml
from helpers.gateway import start_gateway
from helpers.gguf_models import write_twice
from helpers.http import http
from helpers.lora_adapters import write_lora_adapter

from mlxgw.gateway.access.key_admin import create_key

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ownership")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copytree(tiny_dir, allowed / "tiny-copy")
    _, gguf = write_twice("llama", allowed)
    shutil.copytree(tiny_dir, root / "models" / "private")
    adapter = write_lora_adapter(tiny_dir, root / "adapters" / "hr", seed=1)
    keys = root / "keys.yaml"
    admin, _ = create_key(keys, "admin", {"admin": True})
    manager, _ = create_key(keys, "manager", {"manage_models": True, "models": ["team-*"]})
    config = {
        "manager": {"auto_discover": False, "allowed_import_paths": [str(allowed)]},
        "models": [
            {"name": "echo-agent", "engine": "echo"},
            {"name": "private"},
            {"name": "tiny-lora", "source": str(tiny_dir), "adapters": [{"name": "hr-bot", "path": str(adapter)}]},
        ],
    }
    gw = start_gateway(root, config, "ownership-gateway", extra_args=("--keys", str(keys)))
    yield {"gw": gw, "root": root, "allowed": allowed, "gguf": gguf, "admin": admin, "manager": manager, "keys": keys}
    gw.stop()


def call(setup, method: str, path: str, body: dict | None, key: str = "admin", gw=None) -> tuple[int, object]:
    status, _, out = http(f"{(gw or setup['gw']).url}{path}", method, body, {"Authorization": f"Bearer {setup[key]}"})
    return status, out


def entry(setup, name: str) -> dict | None:
    models = yaml.safe_load(setup["gw"].config_path.read_text())["models"]
    return next((m for m in models if m["name"] == name), None)


def chat(setup, model: str, key: str = "admin", gw=None) -> tuple[int, object]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return call(setup, "POST", "/v1/chat/completions", body, key, gw)


def create(setup, body: dict, key: str = "admin") -> tuple[int, object]:
    return call(setup, "POST", "/api/create", {"stream": False, **body}, key)


def test_deleting_a_model_made_from_another_models_folder_leaves_that_folder(setup):
    folder = setup["root"] / "models" / "private"
    assert create(setup, {"model": "team-z", "from": str(folder)})[0] == 200
    assert call(setup, "DELETE", "/api/delete", {"model": "team-z"}, "manager")[0] == 200
    assert folder.is_dir() and entry(setup, "team-z") is None
    assert chat(setup, "private")[0] == 200  # still served from its folder
    # A copy shares the folder and owns none of it: deleting either leaves what the other serves.
    assert call(setup, "POST", "/api/copy", {"source": "private", "destination": "private-copy"})[0] == 200
    assert "owns" not in entry(setup, "private-copy")
    assert call(setup, "DELETE", "/api/delete", {"model": "private-copy"})[0] == 200
    assert folder.is_dir() and chat(setup, "private")[0] == 200


def test_a_gguf_create_owns_its_import_and_its_delete_removes_it(setup):
    assert create(setup, {"model": "team-gguf", "from": str(setup["gguf"])}, "manager")[0] == 200
    made = setup["root"] / "models" / "team-gguf"
    assert entry(setup, "team-gguf")["owns"] == str(made.resolve()) and made.is_dir()
    assert call(setup, "POST", "/api/copy", {"source": "team-gguf", "destination": "team-gguf-2"}, "manager")[0] == 200
    assert call(setup, "DELETE", "/api/delete", {"model": "team-gguf"}, "manager")[0] == 200
    assert made.is_dir() and chat(setup, "team-gguf-2")[0] == 200  # the copy serves from it
    assert call(setup, "DELETE", "/api/delete", {"model": "team-gguf-2"}, "manager")[0] == 200
    assert made.is_dir()  # a copy never owns what it copied


@pytest.mark.parametrize("how", ["folder", "model"])
def test_a_manage_models_key_cannot_start_from_the_folder_of_a_model_it_may_not_use(setup, how):
    if how == "model":  # the operator shared private's folder under a team name
        assert call(setup, "POST", "/api/copy", {"source": "private", "destination": "team-shared"})[0] == 200
    base = str(setup["root"] / "models" / "private") if how == "folder" else "team-shared"
    text = setup["gw"].config_path.read_text()
    status, out = create(setup, {"model": "team-leak", "from": base}, "manager")
    assert status == 403 and "may not start from that folder" in out["error"], out
    status, out = call(setup, "POST", "/api/copy", {"source": base, "destination": "team-leak"}, "manager")
    assert how == "folder" or status == 403, out
    assert setup["gw"].config_path.read_text() == text and chat(setup, "team-leak", "manager")[0] == 404
    if how == "model":
        assert call(setup, "DELETE", "/api/delete", {"model": "team-shared"})[0] == 200
    # A folder no model of another serves is the key's to start from.
    assert create(setup, {"model": "team-own", "from": str(setup["allowed"] / "tiny-copy")}, "manager")[0] == 200


def test_a_created_template_is_the_models_own_and_request_templates_stay_off(setup):
    body = {"model": "team-tmpl", "from": str(setup["allowed"] / "tiny-copy"), "template": TEMPLATE}
    assert create(setup, body)[0] == 200
    assert "allow_request_chat_template" not in json.dumps(entry(setup, "team-tmpl"))
    messages = [{"role": "user", "content": "hi"}]
    status, out = call(setup, "POST", "/tokenize", {"model": "team-tmpl", "messages": messages})
    assert status == 200, out
    status, text = call(setup, "POST", "/detokenize", {"model": "team-tmpl", "tokens": out["tokens"]})
    assert text["prompt"] == "<<hi>>"  # the worker renders the created template as the model's
    asked = {"model": "team-tmpl", "messages": messages, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}
    status, out = call(setup, "POST", "/v1/chat/completions", asked)
    assert status == 400 and "does not accept a chat_template" in out["error"]["message"], out


@pytest.mark.parametrize("num_ctx,says", [(1000000000000, "1000000000000"), (65536, "own context length (32768)")])
def test_num_ctx_is_bounded_by_the_models_own_context(setup, num_ctx, says):
    body = {"model": "team-ctx", "from": str(setup["allowed"] / "tiny-copy"), "parameters": {"num_ctx": num_ctx}}
    status, out = create(setup, body)
    assert status == 400 and says in out["error"] and "num_ctx" in out["error"], out
    assert entry(setup, "team-ctx") is None


def test_copy_and_create_from_a_model_with_adapters_leave_its_adapters_on_it(setup):
    assert call(setup, "POST", "/api/copy", {"source": "tiny-lora", "destination": "lora-copy"})[0] == 200
    assert create(setup, {"model": "lora-made", "from": "tiny-lora", "system": "Be brief."})[0] == 200
    assert "adapters" not in entry(setup, "lora-copy") and "adapters" not in entry(setup, "lora-made")
    assert create(setup, {"model": "tiny-lora", "from": "tiny-lora", "parameters": {"top_k": 5}})[0] == 200
    assert entry(setup, "tiny-lora")["adapters"][0]["name"] == "hr-bot"  # re-created over itself: kept
    assert chat(setup, "lora-copy")[0] == 200 and chat(setup, "hr-bot")[0] == 200


def test_edits_keep_the_last_three_backups_and_no_temp_files(setup):
    for i in range(6):
        assert call(setup, "POST", "/api/copy", {"source": "echo-agent", "destination": f"echo-b{i}"})[0] == 200
    folder = setup["gw"].config_path.parent
    assert len(list(folder.glob("ownership-gateway.yaml.bak-*"))) == 3
    assert not list(folder.glob(".ownership-gateway.yaml.*.tmp"))


def test_show_returns_what_create_was_given(setup):
    admin = ollama.Client(host=setup["gw"].url, headers={"Authorization": f"Bearer {setup['admin']}"})
    messages = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Terse."}]
    admin.create(model="echo-shown", from_="echo-agent", system="Answer in one word.", messages=messages,
                 parameters={"temperature": 0.2, "num_ctx": 2048}, stream=False)  # fmt: skip
    shown = admin.show("echo-shown")  # the client reads modelfile, parameters and details
    assert shown.details.parent_model == "echo-agent"
    status, raw = call(setup, "POST", "/api/show", {"model": "echo-shown"})
    assert status == 200 and raw["system"] == "Answer in one word." and raw["messages"] == messages
    modelfile = shown.modelfile
    for line in ("FROM echo-agent", 'SYSTEM "Answer in one word."', "PARAMETER temperature 0.2",
                 "PARAMETER num_ctx 2048", 'MESSAGE assistant "Terse."'):  # fmt: skip
        assert line in modelfile, modelfile
    assert "temperature 0.2" in shown.parameters
    # The Modelfile creates the same model again (what Open WebUI's model editor does).
    status, out = create(setup, {"model": "echo-shown-2", "modelfile": modelfile})
    assert status == 200, out
    again = entry(setup, "echo-shown-2")
    assert again["chat"]["system"] == "Answer in one word." and again["chat"]["messages"] == messages


def _stream_until_done(setup, model: str, out: dict) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "stream": True}
    body["temperature"] = 0
    status, _, text = http(f"{setup['gw'].url}/v1/chat/completions", "POST", body,
                           {"Authorization": f"Bearer {setup['admin']}"}, timeout=300)  # fmt: skip
    out["status"], out["text"], out["ended"] = status, text, time.monotonic()


def test_delete_while_requests_run_lets_them_finish_and_concurrent_creates_stay_consistent(setup):
    assert create(setup, {"model": "team-busy", "from": str(setup["gguf"])})[0] == 200
    made = setup["root"] / "models" / "team-busy"
    assert chat(setup, "team-busy")[0] == 200  # loaded
    runs = [{} for _ in range(3)]
    threads = [threading.Thread(target=_stream_until_done, args=(setup, "team-busy", r)) for r in runs]
    for t in threads:
        t.start()
    time.sleep(0.2)
    creates: list = []

    def make(i: int) -> None:
        creates.append(create(setup, {"model": f"team-par{i % 3}", "from": "echo-agent"}))

    makers = [threading.Thread(target=make, args=(i,)) for i in range(6)]
    for t in makers:
        t.start()
    assert call(setup, "DELETE", "/api/delete", {"model": "team-busy"})[0] == 200
    deleted = time.monotonic()
    for t in threads + makers:
        t.join(300)
    assert max(run["ended"] for run in runs) > deleted, [r["ended"] - deleted for r in runs]  # still running
    for run in runs:  # each stream ends with its finish (the worker drained), never a 500 or a reset
        assert run["status"] == 200 and run["text"].rstrip().endswith("data: [DONE]"), run
        assert '"finish_reason":"length"' in run["text"] or '"finish_reason":"stop"' in run["text"], run
    assert sorted(s for s, _ in creates) == [200] * 6, creates
    names = [m["name"] for m in yaml.safe_load(setup["gw"].config_path.read_text())["models"]]
    assert sorted(n for n in names if n.startswith("team-par")) == ["team-par0", "team-par1", "team-par2"]
    assert "team-busy" not in names and not made.exists()
    assert not list(made.parent.glob(".trash-*"))
