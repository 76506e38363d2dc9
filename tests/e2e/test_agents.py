"""The real agent clients against a real `mlxgw up`: Claude Code (`claude -p`) and Codex
(`codex exec`), installed from npm by `make setup` into .cache/npm-agents.

The model behind their default model names is the echo engine (it answers with the last
message), so a prompt that *is* tool-call markup makes the "model" call a tool: the CLI runs
the tool for real and sends its result back. A recording proxy between CLI and gateway keeps
what the CLIs really send; `MLXGW_RECORD_FIXTURES=1` writes it to tests/fixtures."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml
from helpers import FIXTURES, openai_client
from helpers.gateway import REPO, start_gateway
from helpers.recording_proxy import RecordingProxy

from mlxgw.shared.config import parse_registry

AGENTS_BIN = REPO / ".cache" / "npm-agents" / "node_modules" / ".bin"
RECORD = os.environ.get("MLXGW_RECORD_FIXTURES") == "1"
CLI_TIMEOUT = 120
ECHO_ALIASES = ["claude-*", "gpt-*", "codex-*"]
AGENT_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        # no tool_parser: the generic tool format, as for the default model
        {"name": "echo-agent", "engine": "echo", "aliases": ECHO_ALIASES, "preload": True, "max_num_seqs": 8},
    ],
}
LOCAL_CODEX_MODEL = "gpt-5-local"  # not in Codex's model catalog; the gpt-* alias serves it
# A 1x1 PNG: what Claude Code's Read tool sends back as an image block.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


def agent_cli(name: str) -> Path:
    """The CLI from `make setup`'s npm cache, else from PATH; skip, saying why, without one."""
    for path in (AGENTS_BIN / name, shutil.which(name)):
        if path and Path(path).exists():
            return Path(path)
    reason = (
        f"{name} is not installed: `make setup` installs Claude Code and Codex from npm into "
        f"{AGENTS_BIN.parent.parent} when node is present ({'npm found' if shutil.which('npm') else 'no npm'})"
    )
    warnings.warn(reason, stacklevel=2)  # shown in the summary even without -rs: never a silent skip
    pytest.skip(reason)


def call(tool: str, **arguments) -> str:
    """A prompt the echo model repeats as a tool call (the generic format's markup)."""
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def agent_gateway(home):
    gw = start_gateway(home, AGENT_CONFIG, "agents-gateway")
    yield gw
    gw.stop()


@pytest.fixture
def proxy(agent_gateway):
    proxy = RecordingProxy(agent_gateway.url).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def workdir(tmp_path) -> Path:
    work = tmp_path / "project"
    work.mkdir()
    (work / "notes.txt").write_text("the secret word is periwinkle\n")
    return work


def run_claude(proxy: RecordingProxy, workdir: Path, prompt: str, *args: str) -> dict:
    """`claude -p` with its default model (no --model), configured for a local server with
    no internet; returns its JSON result."""
    claude = agent_cli("claude")
    home = workdir.parent / "claude-home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": proxy.url,
        "ANTHROPIC_API_KEY": "sk-mlxgw-local",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    cmd = [str(claude), "-p", prompt, "--output-format", "json", *args]
    done = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL
    )
    assert done.stdout.strip(), f"claude printed nothing (rc {done.returncode}):\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["returncode"] = done.returncode
    return result


def run_codex(
    proxy: RecordingProxy, workdir: Path, prompt: str, model: str | None = None
) -> subprocess.CompletedProcess:
    """`codex exec` with a model_provider pointing at the gateway (wire_api responses)."""
    codex = agent_cli("codex")
    codex_home = workdir.parent / "codex-home"
    codex_home.mkdir(exist_ok=True)
    config = 'model_provider = "mlxgw"\n'
    if model:
        config = f'model = "{model}"\n' + config
    config += f'[model_providers.mlxgw]\nname = "mlxgw"\nbase_url = "{proxy.url}/v1"\nwire_api = "responses"\n'
    (codex_home / "config.toml").write_text(config)
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir.parent), "CODEX_HOME": str(codex_home)}
    cmd = [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", prompt]
    return subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL
    )


def record(name: str, body: object) -> None:
    if RECORD:
        (FIXTURES / name).write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")


def shipped_default_model_for(name: str) -> str | None:
    registry = parse_registry(yaml.safe_load((REPO / "config" / "models.yaml").read_text()))
    entry = registry.entry(name)
    return entry.name if entry else None


# -- Claude Code ------------------------------------------------------------------------


def test_claude_code_plain_prompt_completes_with_its_default_model(proxy, workdir):
    result = run_claude(proxy, workdir, "Say hello to the team")
    assert result["returncode"] == 0 and not result["is_error"], result
    assert "Say hello to the team" in result["result"]  # the echo model's answer
    posts = proxy.posts("/v1/messages")
    assert posts and posts[-1].status == 200
    record("claude_code_request.json", posts[0].body)
    # its default model names land on the default chat model of the shipped config
    for name in {p.body["model"] for p in posts}:
        assert name.startswith("claude-") and shipped_default_model_for(name) == "smollm2-135m", name


def test_claude_code_read_tool_round_trip(proxy, workdir):
    result = run_claude(proxy, workdir, call("Read", file_path=str(workdir / "notes.txt")), "--allowedTools", "Read")
    assert result["returncode"] == 0 and not result["is_error"], result
    last = proxy.posts("/v1/messages")[-1]
    assert last.status == 200
    results = [
        b for m in last.body["messages"] for b in m["content"] if isinstance(b, dict) and b["type"] == "tool_result"
    ]
    assert "periwinkle" in json.dumps(results), "Claude Code did not send the file back as a tool result"


def test_claude_code_bash_tool_round_trip(proxy, workdir):
    result = run_claude(proxy, workdir, call("Bash", command="cat notes.txt"), "--allowedTools", "Bash(cat:*)")
    assert result["returncode"] == 0 and not result["is_error"], result
    last = proxy.posts("/v1/messages")[-1]
    assert last.status == 200 and "periwinkle" in json.dumps(last.body["messages"][-1])


def test_claude_code_reading_a_png_continues_the_session(proxy, workdir):
    (workdir / "pixel.png").write_bytes(PNG)
    result = run_claude(proxy, workdir, call("Read", file_path=str(workdir / "pixel.png")), "--allowedTools", "Read")
    posts = proxy.posts("/v1/messages")
    images = [p for p in posts if '"type": "image"' in json.dumps(p.body.get("messages"))]
    assert images, "Claude Code sent no image block"
    record("claude_code_image_tool_result_request.json", images[0].body)
    # every request carrying the image is answered (the text-only model gets a placeholder,
    # named in a header): the session is not dead
    assert [p.status for p in images] == [200] * len(images)
    assert all(p.response_headers.get("x-mlxgw-omitted-content") == "image" for p in images)
    assert result["returncode"] == 0 and not result["is_error"], result


# -- Codex --------------------------------------------------------------------------------


def test_codex_plain_prompt_completes_with_its_default_model(proxy, workdir):
    done = run_codex(proxy, workdir, "Say hello to the team")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Say hello to the team" in done.stdout
    posts = proxy.posts("/v1/responses")
    assert posts and posts[-1].status == 200
    record("codex_default_model_request.json", posts[0].body)
    for name in {p.body["model"] for p in posts}:
        assert shipped_default_model_for(name) == "smollm2-135m", name


def test_codex_exec_command_tool_round_trip(proxy, workdir):
    # A model name outside Codex's catalog (as the README's config.toml sets one): Codex then
    # offers its function tools (exec_command, ...) in `tools`.
    done = run_codex(proxy, workdir, call("exec_command", cmd="cat notes.txt"), model=LOCAL_CODEX_MODEL)
    assert done.returncode == 0, done.stderr[-3000:]
    posts = proxy.posts("/v1/responses")
    record("codex_request.json", posts[0].body)
    outputs = [i for i in posts[-1].body["input"] if i.get("type") == "function_call_output"]
    assert outputs and "periwinkle" in json.dumps(outputs), "Codex did not send the command's output back"
    assert posts[-1].status == 200 and "periwinkle" in done.stdout


def test_codex_default_model_exec_tool_round_trip(proxy, workdir):
    # Codex's own model names run in code mode: its tools come in an `additional_tools` input
    # item and the main one is the freeform (custom) tool `exec`, which runs JavaScript whose
    # nested tools (exec_command, ...) Codex runs for real.
    script = "const r = await tools.exec_command({cmd: 'cat notes.txt'}); text(r.output);"
    done = run_codex(proxy, workdir, call("functions__exec", input=script))
    assert done.returncode == 0, done.stderr[-3000:]
    last = proxy.posts("/v1/responses")[-1]
    items = {i.get("type"): i for i in last.body["input"]}
    assert items["custom_tool_call"]["name"] == "exec" and items["custom_tool_call"]["input"] == script
    assert "periwinkle" in json.dumps(items["custom_tool_call_output"]), "Codex did not send the script's output back"
    assert last.status == 200 and "periwinkle" in done.stdout


# -- a forced tool call with the agents' real tool schemas on the real default model ------


def recorded_tool(fixture: str, name: str) -> dict:
    body = json.loads((FIXTURES / fixture).read_text())
    return next(t for t in body["tools"] if t.get("name") == name)


@pytest.mark.slow
def test_forced_claude_code_read_call_on_the_default_model(real_gateway, workdir):
    import anthropic

    read = recorded_tool("claude_code_request.json", "Read")
    msg = anthropic.Anthropic(base_url=real_gateway.url, api_key="unused", max_retries=0).messages.create(
        model="claude-opus-5-5",
        # room for the whole call: the grammar forces its shape, not its length (a sampled
        # path or optional fields can run past a tight budget and leave the call unfinished)
        max_tokens=256,
        extra_body={"temperature": 0},  # this SDK version no longer takes it as an argument
        messages=[{"role": "user", "content": f"Read the file {workdir / 'notes.txt'}"}],
        # the recorded schema; a short description keeps the prompt short on a slow host
        tools=[{"name": "Read", "description": "Read a file", "input_schema": read["input_schema"]}],
        tool_choice={"type": "tool", "name": "Read"},
    )
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "Read" and isinstance(use.input["file_path"], str)


@pytest.mark.slow
def test_forced_codex_exec_command_call_on_the_default_model(real_gateway):
    tool = recorded_tool("codex_request.json", "exec_command")
    response = openai_client(real_gateway).responses.create(
        model="gpt-6.2-sol",
        input="List the files in this folder.",
        tools=[{**tool, "description": "Run a shell command"}],
        tool_choice="required",
        max_output_tokens=256,
        temperature=0,
    )
    (item,) = [i for i in response.output if i.type == "function_call"]
    assert item.name == "exec_command" and isinstance(json.loads(item.arguments)["cmd"], str)
