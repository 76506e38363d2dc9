"""opencode against a real `mlxgw up`, and the recorded requests of opencode, Qwen Code,
Continue CLI and aider replayed as they were sent.

opencode is installed (pinned) by `make agents` into .cache/npm-agents-extra; without it the
opencode test skips, saying why. The model behind the name the clients were configured with
is the echo engine (it answers with the last message), so a prompt that *is* tool-call markup
makes the "model" call opencode's `write` tool, which opencode runs for real. The replays need
no client: they check that the gateway takes each client's exact first request (its content
parts, stream options, JSON Schema 2020-12 tool schemas) and answers it. How the fixtures were
recorded, and the configs that were run, is in docs/agents.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from helpers import FIXTURES
from helpers.gateway import REPO, start_gateway
from helpers.http import http
from helpers.recording_proxy import RecordingProxy

EXTRA_BIN = REPO / ".cache" / "npm-agents-extra" / "node_modules" / ".bin"
CLI_TIMEOUT = 120
MODEL = "smollm2-135m"  # the name the docs' configs send; here it is served by the echo engine
ECHO_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [{"name": MODEL, "engine": "echo", "preload": True, "max_num_seqs": 8}],
}
# Each client's first request for the task "Create hello.py that prints hi" (docs/agents.md).
RECORDED = [
    "opencode_request.json",
    "qwen_code_request.json",
    "qwen_code_bare_request.json",  # `--bare` with a short system prompt (QWEN_SYSTEM_MD)
    "continue_cli_request.json",
    "aider_request.json",
]
# opencode's switches for a machine with no internet: no update check, model catalog, plugins
# or language servers downloaded at start, no share links, no Claude Code files read.
OPENCODE_OFFLINE = {
    f"OPENCODE_DISABLE_{name}": "1"
    for name in ("AUTOUPDATE", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "SHARE", "CLAUDE_CODE")
}


def opencode_cli() -> Path:
    """opencode from `make agents`' npm cache, else from PATH; skip, saying why, without one."""
    for path in (EXTRA_BIN / "opencode", shutil.which("opencode")):
        if path and Path(path).exists():
            return Path(path)
    reason = (
        f"opencode is not installed: `make agents` installs it from npm into {EXTRA_BIN.parent.parent} "
        f"when node is present ({'npm found' if shutil.which('npm') else 'no npm'})"
    )
    warnings.warn(reason, stacklevel=2)  # shown in the summary even without -rs: never a silent skip
    pytest.skip(reason)


@pytest.fixture(scope="module")
def echo_gateway(home):
    gw = start_gateway(home, ECHO_CONFIG, "agents-extra-gateway")
    yield gw
    gw.stop()


def opencode_config(base_url: str) -> dict:
    """The provider block of docs/agents.md, pointed at base_url."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlxgw": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlxgw",
                "options": {"baseURL": f"{base_url}/v1"},
                "models": {MODEL: {"name": "SmolLM2-135M (mlxgw)"}},
            }
        },
        "model": f"mlxgw/{MODEL}",
    }


def test_opencode_writes_a_file_through_its_write_tool(echo_gateway, tmp_path):
    opencode = opencode_cli()
    work, home = tmp_path / "project", tmp_path / "opencode-home"
    work.mkdir()
    home.mkdir()
    target = work / "hello.py"
    call = {"name": "write", "arguments": {"filePath": str(target), "content": 'print("hi")\n'}}
    prompt = f"<tool_call>{json.dumps(call)}</tool_call>"
    proxy = RecordingProxy(echo_gateway.url).start()
    try:
        (work / "opencode.json").write_text(json.dumps(opencode_config(proxy.url)))
        env = {"PATH": os.environ["PATH"], "HOME": str(home), **OPENCODE_OFFLINE}
        # The prompt on stdin: `opencode run "<words>"` re-quotes an argument holding spaces
        # (the model would get `"<tool_call>..."` with its quotes escaped).
        done = subprocess.run(
            [str(opencode), "run"], input=prompt, cwd=work, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT
        )
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert target.read_text() == 'print("hi")\n', "opencode did not run its write tool"
    posts = proxy.posts("/v1/chat/completions")
    assert posts and all(p.status == 200 for p in posts), [p.status for p in posts]
    assert {p.body["model"] for p in posts} == {MODEL}
    # the tool's result went back to the model on the next turn
    results = [m for p in posts for m in p.body["messages"] if m.get("role") == "tool"]
    assert results and "Wrote file successfully" in json.dumps(results)


@pytest.mark.parametrize("fixture", RECORDED)
@pytest.mark.parametrize("stream", [True, False])
def test_recorded_client_request_is_answered(echo_gateway, fixture, stream):
    body = json.loads((FIXTURES / fixture).read_text())
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)
    status, _, out = http(f"{echo_gateway.url}/v1/chat/completions", "POST", body)
    assert status == 200, out
    if stream:  # SSE text: chunks, the usage when the client asked for it, then [DONE]
        assert out.rstrip().endswith("data: [DONE]"), out[-500:]
        assert ('"prompt_tokens"' in out) == bool(body.get("stream_options", {}).get("include_usage"))
    else:
        assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["message"]["content"]


def test_forced_tool_choice_on_the_echo_engine_names_tool_choice(echo_gateway):
    # The echo engine has no constrained decoding: a forced call is a clean 400 that names the
    # field that forced it (it named response_format, which the request did not send).
    body = json.loads((FIXTURES / "opencode_request.json").read_text())
    body.update(stream=False, tool_choice="required")
    body.pop("stream_options", None)
    status, _, out = http(f"{echo_gateway.url}/v1/chat/completions", "POST", body)
    assert status == 400 and out["error"]["param"] == "tool_choice", out
