"""`mlxgw launch CLIENT` against a real `mlxgw up` on the echo engine.

`--print` is parsed for every client (its `export` lines are what the client gets); config
files are merged into existing ones (foreign keys kept, a backup, a diff); keys are created
once and reused; and the real Claude Code, Codex and opencode (installed by `make agents`
into .cache/npm-agents*) are launched and run a one-file task through their own write/exec
tools. A client that is not installed skips, saying why."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit
import yaml
from helpers.gateway import REPO, start_gateway

from mlxgw.gateway.access.key_admin import create_key
from mlxgw.gateway.cli.launch.core import DELETE, ConfigEdit, planned_text

BINS = [
    *(
        REPO / ".cache" / name / "node_modules" / ".bin"
        for name in ("npm-agents", "npm-agents-extra", "npm-agents-launch")
    ),
    REPO / ".cache" / "aider-venv" / "bin",
]
CLI_TIMEOUT = 120
CLIENTS = ["claude", "codex", "opencode", "qwen", "aider", "continue", "crush", "goose"]
ECHO_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "echo-agent", "engine": "echo", "aliases": ["claude-*", "gpt-*", "codex-*"], "preload": True},
        {"name": "echo-other", "engine": "echo", "context_length": 4096},
    ],
}
# A stand-in client for the clients not installed here: prints what it was started with.
STAND_IN = (
    f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'argv': sys.argv[1:], 'env': dict(os.environ)}}))\n"
)


@pytest.fixture(scope="module")
def echo_gateway(home):
    gw = start_gateway(home, ECHO_CONFIG, "launch-gateway")
    yield gw
    gw.stop()


@pytest.fixture
def user_home(tmp_path) -> Path:
    """A fresh HOME and MLXGW_HOME for the launched client (its config files land here)."""
    (tmp_path / "user").mkdir()
    (tmp_path / "mlxgw-home").mkdir()
    return tmp_path


def launch(
    user_home: Path, url: str, *args: str, path_dirs=(), stdin: str | None = None, mlxgw_home: Path | None = None
) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.pathsep.join([*map(str, path_dirs), *map(str, BINS), os.environ["PATH"]]),
        "HOME": str(user_home / "user"),
        "MLXGW_HOME": str(mlxgw_home or user_home / "mlxgw-home"),
        "PYTHONPATH": os.environ["PYTHONPATH"],
        "ANTHROPIC_API_KEY": "sk-ant-users-own-key",  # must not reach the local server
    }
    work = user_home / "project"
    work.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "mlxgw", "launch", "--url", url, *args]
    return subprocess.run(
        cmd,
        cwd=work,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def exports(out: str) -> dict[str, str]:
    """The `export NAME=VALUE` lines of --print, as a shell reads them."""
    found = {}
    for line in out.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            found[name] = shlex.split(value)[0] if value else ""
    return found


def stand_in(folder: Path, name: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(STAND_IN)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def installed(name: str) -> Path:
    for folder in BINS:
        if (folder / name).exists():
            return folder / name
    pytest.skip(f"{name} is not installed: `make agents` installs it (npm, or pip for aider) under {REPO / '.cache'}")


# -- --print for every client --------------------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
def test_print_shows_the_settings_and_writes_nothing(echo_gateway, user_home, client):
    done = launch(user_home, echo_gateway.url, "--print", client)
    assert done.returncode == 0, done.stderr
    env = exports(done.stdout)
    assert "model echo-agent" in done.stdout and "keys off" in done.stdout  # the claude-*/gpt-* aliases' model
    assert f"{echo_gateway.url}" in done.stdout
    assert not any((user_home / "user").iterdir()) and not (user_home / "mlxgw-home" / "launch").exists()
    if client == "claude":
        assert env["ANTHROPIC_BASE_URL"] == echo_gateway.url and env["ANTHROPIC_MODEL"] == "echo-agent"
        assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "echo-agent" and env["DISABLE_TELEMETRY"] == "1"
        assert int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) >= 300_000
        assert int(env["API_TIMEOUT_MS"]) > int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"])
        assert "unset ANTHROPIC_API_KEY" in done.stdout
    elif client == "codex":
        assert "codex --profile mlxgw" in done.stdout and 'wire_api = "responses"' in done.stdout
        assert "env_key" not in done.stdout  # keys off: Codex would refuse to start without the variable
    elif client == "opencode":
        assert json.loads(env["OPENCODE_CONFIG_CONTENT"])["model"] == "mlxgw/echo-agent"
        assert '"chunkTimeout"' in done.stdout
    elif client in ("qwen", "goose"):
        assert env["OPENAI_API_KEY"] == "mlxgw-no-key" and "echo-agent" in env.values()
    elif client == "aider":
        assert env["OPENAI_API_BASE"] == f"{echo_gateway.url}/v1" and "--analytics-disable" in done.stdout


def test_model_option_resolves_and_sets_context_from_the_server(echo_gateway, user_home):
    done = launch(user_home, echo_gateway.url, "--print", "--model", "echo-other", "claude")
    env = exports(done.stdout)
    assert env["ANTHROPIC_MODEL"] == "echo-other" and env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "4096"
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in env  # Claude Code would refuse its own first request
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"
    missing = launch(user_home, echo_gateway.url, "--print", "--model", "no-such-model", "claude")
    assert missing.returncode == 2 and "no-such-model" in missing.stderr


def test_no_server_is_a_clear_error(user_home):
    done = launch(user_home, "http://127.0.0.1:9", "--print", "claude")
    assert done.returncode == 2 and "mlxgw up" in done.stderr


def test_missing_client_gets_the_install_command(echo_gateway, user_home, tmp_path):
    done = launch(user_home, echo_gateway.url, "crush", path_dirs=[tmp_path / "empty"])
    if done.returncode != 127:
        pytest.skip("crush is installed here")
    assert "npm install -g @charmland/crush" in done.stderr


# -- config files ---------------------------------------------------------------------------------


def test_opencode_config_is_merged_with_a_backup_and_a_diff(echo_gateway, user_home, tmp_path):
    config = user_home / "user" / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    mine = {"theme": "tokyonight", "model": "anthropic/claude-x", "provider": {"other": {"name": "mine"}}}
    config.write_text(json.dumps(mine))
    done = launch(
        user_home, echo_gateway.url, "opencode", "--", "run", path_dirs=[stand_in(tmp_path / "bin", "opencode")]
    )
    assert done.returncode == 0, done.stderr
    merged = json.loads(config.read_text())
    assert merged["theme"] == "tokyonight" and merged["model"] == "anthropic/claude-x"
    assert merged["provider"]["other"] == {"name": "mine"}
    assert merged["provider"]["mlxgw"]["options"]["baseURL"] == f"{echo_gateway.url}/v1"
    (backup,) = config.parent.glob("opencode.json.bak-*")
    assert json.loads(backup.read_text()) == mine
    assert '+      "name": "mlxgw",' in done.stdout  # the diff
    started = json.loads(done.stdout.strip().splitlines()[-1])  # the stand-in's report
    assert started["argv"] == ["run"] and "ANTHROPIC_API_KEY" in started["env"]  # only claude unsets it
    # a second launch changes nothing and makes no second backup
    again = launch(user_home, echo_gateway.url, "opencode", "--", "run", path_dirs=[tmp_path / "bin"])
    assert "already set" in again.stdout and len(list(config.parent.glob("opencode.json.bak-*"))) == 1


def test_codex_profile_leaves_the_users_config_alone(echo_gateway, user_home, tmp_path):
    codex_home = user_home / "user" / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text('# mine\nmodel = "gpt-5"\n')
    (codex_home / "mlxgw.config.toml").write_text('# kept\nmodel_reasoning_effort = "low"\n[tui]\nx = 1\n')
    done = launch(
        user_home, echo_gateway.url, "codex", "--", "exec", "hi", path_dirs=[stand_in(tmp_path / "bin", "codex")]
    )
    assert done.returncode == 0, done.stderr
    assert (codex_home / "config.toml").read_text() == '# mine\nmodel = "gpt-5"\n'
    text = (codex_home / "mlxgw.config.toml").read_text()
    layer = tomlkit.parse(text).unwrap()
    assert "# kept" in text and layer["model_reasoning_effort"] == "low" and layer["tui"] == {"x": 1}
    assert layer["model_provider"] == "mlxgw" and layer["model_providers"]["mlxgw"]["wire_api"] == "responses"
    assert list(codex_home.glob("mlxgw.config.toml.bak-*"))
    assert json.loads(done.stdout.strip().splitlines()[-1])["argv"] == ["--profile", "mlxgw", "exec", "hi"]


def test_codex_env_key_leaves_the_layer_when_keys_go_off(tmp_path):
    layer = tmp_path / "mlxgw.config.toml"
    layer.write_text('# mine\n[model_providers.mlxgw]\nenv_key = "MLXGW_API_KEY"\nname = "mlxgw"\n')
    _, new = planned_text(ConfigEdit(layer, "toml", {"model_providers": {"mlxgw": {"env_key": DELETE}}}))
    assert "env_key" not in new and "# mine" in new and 'name = "mlxgw"' in new


def test_a_broken_config_file_is_never_overwritten(echo_gateway, user_home, tmp_path):
    settings = user_home / "user" / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text("{ // a comment Qwen Code allows\n}")
    done = launch(user_home, echo_gateway.url, "qwen", path_dirs=[stand_in(tmp_path / "bin", "qwen")])
    assert done.returncode == 2 and "not valid JSON" in done.stderr
    assert settings.read_text() == "{ // a comment Qwen Code allows\n}"


# -- keys -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys_gateway(tmp_path_factory):
    """A gateway with keys on; its MLXGW_HOME is the launcher's, so launch can create a key."""
    keys_home = tmp_path_factory.mktemp("launch-keys") / "mlxgw-home"
    create_key(keys_home / "keys.yaml", "operator", {"admin": True})
    gw = start_gateway(keys_home, ECHO_CONFIG, "launch-keys", extra_args=("--keys", str(keys_home / "keys.yaml")))
    yield gw, keys_home
    gw.stop()


def test_a_key_is_created_once_and_reused(keys_gateway, user_home, tmp_path):
    gw, keys_home = keys_gateway
    home = {"mlxgw_home": keys_home}
    printed = launch(user_home, gw.url, "--print", "claude", **home)
    assert "would create key" in printed.stdout and not (keys_home / "launch-key").exists()
    bin_dir = stand_in(tmp_path / "bin", "claude")
    first = launch(user_home, gw.url, "claude", "--", "-p", "hi", path_dirs=[bin_dir], **home)
    assert first.returncode == 0, first.stderr
    token = json.loads(first.stdout.strip().splitlines()[-1])["env"]["ANTHROPIC_AUTH_TOKEN"]
    assert token.startswith("mlxgw-")
    assert token not in first.stdout.strip().rsplit("\n", 1)[0] + first.stderr  # launch never prints it
    assert (keys_home / "launch-key").stat().st_mode & 0o077 == 0
    second = launch(user_home, gw.url, "claude", "--", "-p", "hi", path_dirs=[bin_dir], **home)
    assert json.loads(second.stdout.strip().splitlines()[-1])["env"]["ANTHROPIC_AUTH_TOKEN"] == token
    names = [k["name"] for k in yaml.safe_load((keys_home / "keys.yaml").read_text())["keys"]]
    assert len([n for n in names if n.startswith("launch-")]) == 1
    refused = launch(user_home, gw.url, "--print", "--key", "mlxgw-wrong", "claude", **home)
    assert refused.returncode == 2 and "refuses the given key" in refused.stderr


def test_claude_code_and_codex_with_keys_on(keys_gateway, user_home):
    gw, keys_home = keys_gateway
    claude, codex = installed("claude"), installed("codex")
    assert claude and codex
    done = launch(user_home, gw.url, "claude", "--", "-p", "Say hi", "--output-format", "json", mlxgw_home=keys_home)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["is_error"] and "Say hi" in result["result"], result
    # Codex sends the key from the variable its provider's env_key names
    done = launch(user_home, gw.url, "codex", "--", "exec", "--skip-git-repo-check", "Say hi", mlxgw_home=keys_home)
    assert done.returncode == 0 and "Say hi" in done.stdout, done.stderr[-3000:]
    layer = (user_home / "user" / ".codex" / "mlxgw.config.toml").read_text()
    assert 'env_key = "MLXGW_API_KEY"' in layer


# -- the real clients: a one-file task through their own tools ------------------------------------


def call(tool: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def test_claude_code_launched_writes_a_file(echo_gateway, user_home):
    installed("claude")
    target = user_home / "project" / "hello.py"
    prompt = call("Write", file_path=str(target), content='print("hi")\n')
    done = launch(
        user_home, echo_gateway.url, "claude", "--", "-p", prompt, "--allowedTools", "Write", "--output-format", "json"
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["is_error"], result
    assert target.read_text() == 'print("hi")\n'
    assert result["modelUsage"]["echo-agent"]["contextWindow"] == 32768  # the server's context, not 1,000,000


def test_codex_launched_runs_a_command_that_writes_a_file(echo_gateway, user_home):
    installed("codex")
    prompt = call("exec_command", cmd="printf 'print(1)\\n' > hello.py")
    done = launch(
        user_home,
        echo_gateway.url,
        "codex",
        "--",
        "exec",
        "--skip-git-repo-check",
        "--sandbox",
        "danger-full-access",
        prompt,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (user_home / "project" / "hello.py").read_text() == "print(1)\n"


def test_opencode_launched_writes_a_file(echo_gateway, user_home):
    installed("opencode")
    target = user_home / "project" / "hello.py"
    prompt = call("write", filePath=str(target), content='print("hi")\n')
    done = launch(user_home, echo_gateway.url, "opencode", "--", "run", stdin=prompt)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert target.read_text() == 'print("hi")\n'


def test_qwen_code_launched_writes_a_file(echo_gateway, user_home):
    installed("qwen")
    target = user_home / "project" / "hello.py"
    prompt = call("write_file", file_path=str(target), content='print("hi")\n')
    done = launch(user_home, echo_gateway.url, "qwen", "--", prompt, "--yolo")  # the prompt first (docs/agents.md)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert target.read_text() == 'print("hi")\n'


def test_continue_cli_launched_writes_a_file(echo_gateway, user_home):
    installed("cn")
    target = user_home / "project" / "hello.py"
    prompt = call("Write", filepath=str(target), content='print("hi")\n')
    done = launch(user_home, echo_gateway.url, "continue", "--", "--auto", "-p", prompt)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert target.read_text() == 'print("hi")\n'


def test_aider_launched_writes_a_file(echo_gateway, user_home):
    installed("aider")
    # the echo model repeats the request: a whole-file edit in aider's format
    listing = 'hello.py\n```python\nprint("hi")\n```'
    done = launch(user_home, echo_gateway.url, "aider", "--", "--no-git", "--yes-always", "--message", listing)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (user_home / "project" / "hello.py").read_text() == 'print("hi")\n'
