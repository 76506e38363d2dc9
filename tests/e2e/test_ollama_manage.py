"""Ollama's model management (/api/pull, /api/delete, /api/copy, /api/create) on a real
`mlxgw up` with keys, through the official `ollama` Python client where it has the call.

Every change lands in models.yaml with a backup; hostile inputs (paths outside the allowed
folders, a symlink out of them, `../` names, template bombs, an ordinary key) are refused in
Ollama's error shape, and the file is left as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import ollama
import pytest
import yaml
from helpers.fake_hub import hub_environment, tiny_model_hub
from helpers.gateway import REPO, start_gateway
from helpers.http import http
from helpers.paths import FIXTURES

from mlxgw.gateway.access.key_admin import create_key
from mlxgw.gateway.pipeline.translate import with_entry_preamble
from mlxgw.shared.model_sections import ChatConfig, ModelEntry, PresetMessage

# Within Jinja's sandbox range limit (100,000), so the loops really run: 10^10 iterations.
LOOPING_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    # A home of its own: pulled models land in its models directory, not the session's.
    root = tmp_path_factory.mktemp("manage")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copytree(tiny_dir, allowed / "tiny-copy")
    (allowed / "escape").symlink_to(tiny_dir)  # a link inside the allowed folder to a folder outside
    keys = root / "keys.yaml"
    admin, _ = create_key(keys, "admin", {"admin": True})
    user, _ = create_key(keys, "user", {})
    manager, _ = create_key(keys, "manager", {"manage_models": True, "models": ["echo-*", "team-*"]})
    config = {
        "manager": {"auto_discover": False, "allowed_import_paths": [str(allowed)]},
        "models": [{"name": "echo-agent", "engine": "echo", "preload": True}],
    }
    hub = tiny_model_hub(tiny_dir)
    with hub_environment(hub, root):
        gw = start_gateway(root, config, "manage-gateway", extra_args=("--keys", str(keys)))
    yield {"gw": gw, "admin": admin, "user": user, "manager": manager, "allowed": allowed, "root": root, "hub": hub}
    gw.stop()
    hub.stop()


def client(setup, key: str = "admin") -> ollama.Client:
    return ollama.Client(host=setup["gw"].url, headers={"Authorization": f"Bearer {setup[key]}"})


def call(setup, method: str, path: str, body: dict, key: str = "admin") -> tuple[int, object]:
    status, _, out = http(f"{setup['gw'].url}{path}", method, body, {"Authorization": f"Bearer {setup[key]}"})
    return status, out


def registry(setup) -> dict:
    return yaml.safe_load(setup["gw"].config_path.read_text())


def entry(setup, name: str) -> dict | None:
    return next((m for m in registry(setup)["models"] if m["name"] == name), None)


def test_copy_create_and_delete_with_the_ollama_client(setup):
    admin = client(setup)
    before = len(list(setup["gw"].config_path.parent.glob(f"{setup['gw'].config_path.name}.bak-*")))
    assert admin.copy("echo-agent", "echo-copy").status == "success"
    assert "echo-copy" in [m.model for m in admin.list().models]
    done = admin.create(
        model="echo-terse:latest",
        from_="echo-copy",
        system="Answer in one word.",
        parameters={"temperature": 0.2, "num_ctx": 2048, "num_predict": 64},
        messages=[{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Terse."}],
        stream=False,
    )
    assert done.status == "success"
    created = entry(setup, "echo-terse")
    assert created["engine"] == "echo" and created["source"] == "echo-agent"  # the copy's weights
    assert created["defaults"] == {"temperature": 0.2, "max_tokens": 64} and created["context_length"] == 2048
    assert created["chat"]["system"] == "Answer in one word." and len(created["chat"]["messages"]) == 2
    assert admin.chat(model="echo-terse", messages=[{"role": "user", "content": "hi"}]).message.content == "hi"
    assert admin.delete("echo-copy").status == "success"
    assert entry(setup, "echo-copy") is None and "echo-copy" not in [m.model for m in admin.list().models]
    with pytest.raises(ollama.ResponseError) as err:
        admin.delete("echo-copy")
    assert err.value.status_code == 404 and "not found" in err.value.error
    after = len(list(setup["gw"].config_path.parent.glob(f"{setup['gw'].config_path.name}.bak-*")))
    assert before <= 3 and after == 3  # copy, create, delete: one backup each, the last three kept


def test_a_modelfile_text_is_read(setup):
    modelfile = (
        'FROM echo-agent\nPARAMETER temperature 0.3\nPARAMETER top_k 20\nSYSTEM """Two\nlines."""\n'
        "MESSAGE user hello there\n# a comment\nLICENSE MIT\n"
    )
    status, out = call(setup, "POST", "/api/create", {"model": "echo-mf", "modelfile": modelfile, "stream": False})
    assert status == 200, out
    created = entry(setup, "echo-mf")
    assert created["defaults"] == {"temperature": 0.3, "top_k": 20} and created["chat"]["system"] == "Two\nlines."
    assert created["chat"]["messages"] == [{"role": "user", "content": "hello there"}]


def test_create_streams_ollamas_progress_lines(setup):
    status, out = call(setup, "POST", "/api/create", {"model": "echo-streamed", "from": "echo-agent"})
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 200 and lines[-1] == {"status": "success"}


def test_create_from_a_folder_in_the_allowed_folders_and_a_looping_template(setup):
    # The looping template parses, so it is stored; the worker's budgeted sandbox ends the
    # render when a request uses it: a 400 in Ollama's shape, not a hung worker.
    path = str(setup["allowed"] / "tiny-copy")
    status, out = call(
        setup,
        "POST",
        "/api/create",
        {"model": "tiny-bomb", "from": path, "template": LOOPING_TEMPLATE, "stream": False},
    )
    assert status == 200, out
    assert entry(setup, "tiny-bomb")["source"] == path
    started = time.monotonic()
    status, out = call(
        setup,
        "POST",
        "/api/chat",
        {"model": "tiny-bomb", "messages": [{"role": "user", "content": "hi"}], "stream": False},
    )
    assert status == 400 and "template" in out["error"], out
    assert time.monotonic() - started < 60
    status, out = call(
        setup,
        "POST",
        "/api/chat",
        {"model": "echo-agent", "messages": [{"role": "user", "content": "ok"}], "stream": False},
    )
    assert status == 200  # the other models are unaffected


def test_a_broken_gguf_in_the_allowed_folders_is_a_clear_error(setup):
    (setup["allowed"] / "broken.gguf").write_bytes(b"GGUF but not really")
    body = {"model": "broken", "from": str(setup["allowed"] / "broken.gguf"), "stream": False}
    status, out = call(setup, "POST", "/api/create", body)
    assert status == 400 and "importing the GGUF failed" in out["error"], out
    assert entry(setup, "broken") is None


def test_create_replaces_its_own_entry(setup):
    admin = client(setup)
    admin.create(model="echo-again", from_="echo-agent", parameters={"temperature": 0.5}, stream=False)
    admin.create(model="echo-again", from_="echo-again", parameters={"top_p": 0.9}, stream=False)
    assert entry(setup, "echo-again")["defaults"] == {"temperature": 0.5, "top_p": 0.9}


@pytest.mark.parametrize(
    "base",
    [
        "/etc",  # outside every allowed folder
        "/etc/passwd.gguf",
        "ALLOWED/../../../etc",  # resolves outside
        "ALLOWED/escape",  # a link inside that points outside
    ],
)
def test_from_paths_outside_the_allowed_folders_are_refused(setup, base):
    text = setup["gw"].config_path.read_text()
    base = base.replace("ALLOWED", str(setup["allowed"]))
    status, out = call(setup, "POST", "/api/create", {"model": "escapee", "from": base, "stream": False})
    assert status == 403 and set(out) == {"error"} and "outside the folders" in out["error"], out
    assert setup["gw"].config_path.read_text() == text


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/api/create", {"model": "../evil", "from": "echo-agent"}),
        ("POST", "/api/create", {"model": "a/b", "from": "echo-agent"}),
        ("POST", "/api/copy", {"source": "echo-agent", "destination": "../../evil"}),
        ("POST", "/api/copy", {"source": "echo-agent", "destination": ".hidden"}),
        ("DELETE", "/api/delete", {"model": "../../etc"}),
        ("POST", "/api/pull", {"model": "../../etc/passwd"}),
        ("POST", "/api/create", {"model": "rel", "from": "relative/path.gguf"}),
    ],
)
def test_hostile_names_are_refused(setup, method, path, body):
    text = setup["gw"].config_path.read_text()
    status, out = call(setup, method, path, body)
    assert status == 400 and set(out) == {"error"}, out
    assert setup["gw"].config_path.read_text() == text


@pytest.mark.parametrize(
    "body,says",
    [
        ({"template": "{{ 'x' }}" * 5000}, "over 32 KB"),  # a huge template
        ({"template": "{{ .System }} {{ .Prompt }}"}, "Go template"),
        ({"template": "{% for x in y %}"}, "not a valid Jinja template"),
        ({"template": "{% if a %}" * 1000 + "{% endif %}" * 1000}, "nests too deeply"),
        ({"modelfile": "FROM echo-agent\nADAPTER ./lora.safetensors"}, "ADAPTER"),
        ({"parameters": {"stop": ["x"]}}, "PARAMETER stop"),
        ({"parameters": {"temperature": "hot"}}, "must be a float"),
        ({"modelfile": "FROM echo-agent\n" + "SYSTEM x\n" * 20000}, "over 64 KB"),
        ({"path": "/etc/Modelfile"}, "not read"),
        ({"from": "no-such-model"}, "not found"),
    ],
)
def test_bad_create_bodies_are_refused(setup, body, says):
    text = setup["gw"].config_path.read_text()
    status, out = call(setup, "POST", "/api/create", {"model": "bad", "from": "echo-agent", **body, "stream": False})
    assert status in (400, 404) and says in out["error"], out
    assert setup["gw"].config_path.read_text() == text


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/api/pull", {"model": "org/model"}),
        ("DELETE", "/api/delete", {"model": "echo-agent"}),
        ("POST", "/api/copy", {"source": "echo-agent", "destination": "mine"}),
        ("POST", "/api/create", {"model": "mine", "from": "echo-agent"}),
    ],
)
def test_an_ordinary_key_is_refused_in_ollamas_shape(setup, method, path, body):
    status, out = call(setup, method, path, body, key="user")
    assert status == 403 and set(out) == {"error"} and "admin key" in out["error"]
    assert entry(setup, "echo-agent") is not None and entry(setup, "mine") is None


def test_a_key_granted_manage_models_changes_only_the_models_it_names(setup):
    """`manage_models: true` opens the four routes to a key that is not an admin, for the
    names its `models` patterns allow: the model copied from as well as the new one."""
    assert call(setup, "POST", "/api/copy", {"source": "echo-agent", "destination": "team-copy"}, "manager")[0] == 200
    assert entry(setup, "team-copy") is not None
    for path, body in [
        ("/api/copy", {"source": "echo-agent", "destination": "elsewhere"}),
        ("/api/create", {"model": "team-made", "from": "tiny-outside"}),
        ("/api/delete", {"model": "not-ours"}),
    ]:
        status, out = call(setup, "POST" if path != "/api/delete" else "DELETE", path, body, "manager")
        assert status == 403 and "may not manage model" in out["error"], (path, out)
    assert entry(setup, "elsewhere") is None and entry(setup, "team-made") is None
    assert call(setup, "DELETE", "/api/delete", {"model": "team-copy"}, "manager")[0] == 200
    assert entry(setup, "team-copy") is None


def test_pull_streams_progress_and_serves_the_model(setup):
    admin = client(setup)
    statuses = [part.status for part in admin.pull("hf.co/org/tiny-mlx", stream=True)]
    assert statuses[0] == "pulling org/tiny-mlx" and statuses[-1] == "success", statuses
    folder = setup["root"] / "models" / "tiny-mlx"
    assert entry(setup, "tiny-mlx") == {"name": "tiny-mlx", "owns": str(folder.resolve())}  # the pull's own folder
    assert (folder / "config.json").exists()
    assert "tiny-mlx" in [m.model for m in admin.list().models]
    assert admin.delete("tiny-mlx").status == "success"
    assert not folder.exists() and entry(setup, "tiny-mlx") is None  # the entry and its folder


def test_pulling_a_pulled_models_name_updates_it_from_its_repository(setup):
    """Ollama clients pull an installed model by its name to update it (Open WebUI's "Update
    All Models" pulls every listed model): a model pulled from the hub is pulled again from the
    repository it came from; another model's name is refused saying why."""
    admin = client(setup)
    assert admin.pull("org/tiny-mlx", stream=False).status == "success"
    statuses = [part.status for part in admin.pull("tiny-mlx:latest", stream=True)]
    assert statuses[0] == "pulling org/tiny-mlx" and statuses[-1] == "success", statuses
    assert entry(setup, "tiny-mlx")["name"] == "tiny-mlx"
    with pytest.raises(ollama.ResponseError) as err:
        admin.pull("echo-agent", stream=False)
    assert err.value.status_code == 400 and "was not pulled from the Hugging Face hub" in err.value.error
    assert admin.delete("tiny-mlx").status == "success"


OLLAMA_JS = REPO / ".cache" / "npm-agents-launch" / "node_modules"
JS_CALLS = """
const { Ollama } = require('ollama');
const o = new Ollama({ host: process.env.HOST, headers: { Authorization: 'Bearer ' + process.env.KEY } });
const refused = (p) => p.then(() => 'accepted', (e) => ({ error: e.error, status: e.status_code }));
(async () => {
  const out = {};
  out.copy = await o.copy({ source: 'echo-agent', destination: 'js-copy' });
  out.create = await o.create({ model: 'js-made', from: 'js-copy', system: 'Be brief.', stream: false });
  out.delete = await o.delete({ model: 'js-copy' });
  out.name = await refused(o.create({ model: '../x', from: 'echo-agent', stream: false }));
  out.pull = await refused(o.pull({ model: '../../etc', stream: false }));
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def test_the_ollama_js_client(setup):
    if not (OLLAMA_JS / "ollama").is_dir():
        pytest.skip(f"ollama-js is not installed: `make agents` installs it from npm into {OLLAMA_JS.parent}")
    env = dict(os.environ, NODE_PATH=str(OLLAMA_JS), HOST=setup["gw"].url, KEY=setup["admin"])
    done = subprocess.run(["node", "-e", JS_CALLS], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["copy"] == {"status": "success"} and out["delete"] == {"status": "success"}
    assert out["create"]["status"] == "success" and entry(setup, "js-made")["chat"]["system"] == "Be brief."
    assert out["name"]["status"] == 400 and "invalid model name" in out["name"]["error"]
    assert out["pull"]["status"] == 400 and "Hugging Face repository" in out["pull"]["error"]


def test_pull_with_the_hub_unreachable_is_a_clear_error(setup):
    setup["hub"].stop()  # nothing answers at HF_ENDPOINT any more
    admin = client(setup)
    with pytest.raises(ollama.ResponseError) as err:
        admin.pull("hf.co/some-org/some-model", stream=False)
    assert err.value.status_code == 502 and "cannot reach the hub" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:  # streamed: progress lines, then the error line
        for _ in admin.pull("some-org/some-model", stream=True):
            pass
    assert "cannot reach the hub" in err.value.error
    assert entry(setup, "some-model") is None


def test_open_webuis_recorded_requests(setup):
    """What Open WebUI 0.12's Manage Models dialog and its /ollama/api/* routes sent to mlxgw
    (recorded by tests/e2e/test_openwebui.py, which runs only where Open WebUI is installed):
    two pulls (here the hub is stopped by now: each ends in an error line), create from a model
    with a system prompt, copy, delete the copy, delete the model, delete it again."""
    recorded = json.loads((FIXTURES / "openwebui_manage_requests.json").read_text())
    for sent in recorded:
        status, out = call(setup, sent["method"], sent["path"], sent["body"])
        assert status == sent["status"], (sent, out)
        if sent["path"] == "/api/pull":  # a stream: progress, then success or the error Open WebUI shows
            last = json.loads(out.splitlines()[-1])
            assert last == {"status": "success"} or last["error"].startswith(f"pull {sent['body']['model']}: "), last
        elif sent["path"] == "/api/create":
            created = entry(setup, "owui-terse")
            assert created["chat"]["system"] == "Answer in one word." and created["engine"] == "echo", created
        elif sent["path"] == "/api/copy":
            assert entry(setup, "owui-terse-copy") is not None
    assert entry(setup, "owui-terse") is None and entry(setup, "owui-terse-copy") is None


def test_changes_are_recorded_in_the_ledger(setup):
    call(setup, "POST", "/api/copy", {"source": "echo-agent", "destination": "echo-ledger"})
    status, out = call(setup, "GET", "/v1/usage?by=api&since=1h", None)
    apis = {row["api"] for row in out["data"]}
    assert status == 200 and {"/api/copy", "/api/create"} <= apis, apis


def test_entry_preamble_order():
    preset = [PresetMessage("user", "q"), PresetMessage("assistant", "a")]
    entry = ModelEntry(name="m", chat=ChatConfig(system="be brief", messages=preset))
    asked = [{"role": "user", "content": "hi"}]
    assert [m["content"] for m in with_entry_preamble(entry, asked)] == ["be brief", "q", "a", "hi"]
    own = [{"role": "system", "content": "mine"}, *asked]
    assert [m["content"] for m in with_entry_preamble(entry, own)] == ["mine", "q", "a", "hi"]
    assert with_entry_preamble(ModelEntry(name="plain"), asked) is asked
