"""MCP tools run by the gateway: a real stdio MCP server (tests/fixtures/mcp_notes_server.py,
FastMCP) connected by a real `mlxgw up`, driven through the official openai SDK.

The echo engine repeats the last message, so the model's tool call is exactly the one the
user message spells, and after the gateway runs it the model's answer is exactly the tool's
result (the last message is then the tool message)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest
import yaml
from helpers import FIXTURES, free_port, http, start_gateway, wait_for

from mlxgw.gateway.access.keys import hash_key
from mlxgw.shared.config import ConfigError, parse_registry

ADMIN = "mlxgw-mcp-admin-0123456789"
USER = "mlxgw-mcp-user-0123456789"
TIMEOUT_S = 2.0  # the files server's per-call timeout
MAX_TURNS = 3
FILES = [{"type": "mcp", "server_label": "files"}]
NOTE = "the note says 42"
SERVER_SCRIPT = FIXTURES / "mcp_notes_server.py"


def call(tool: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{tool}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def notes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("notes")
    (root / "today.txt").write_text(NOTE)
    (root / "loop.txt").write_text(call("read_note", name="loop.txt"))  # reading it asks to read it again
    return root


def accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def http_server(notes):
    """The same MCP server over streamable HTTP, run by the test on a loopback port."""
    port = free_port()
    env = dict(os.environ, NOTES_DIR=str(notes))
    proc = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "--http", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: accepts(port), timeout=60)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(30)


def files_server(notes: Path, **extra) -> dict:
    return {
        "label": "files",
        "command": sys.executable,
        "args": [str(SERVER_SCRIPT)],
        "env": {"NOTES_DIR": str(notes)},
        "allowed_tools": ["add", "read_note", "hang"],
        "timeout_s": TIMEOUT_S,
        **extra,
    }


def mcp_server_pids(gw) -> list[int]:
    """The gateway's stdio MCP server processes."""
    found = []
    for pid in gw.descendants():
        try:
            if str(SERVER_SCRIPT) in psutil.Process(pid).cmdline():
                found.append(pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def gw(home, notes, http_server, tmp_path_factory):
    keys_path = tmp_path_factory.mktemp("mcp-keys") / "keys.yaml"
    # The user key may use every server here, "broken" (no allowed_tools) included (a
    # server exposing all its tools is otherwise for admin keys only).
    user = {"name": "user", "sha256": hash_key(USER), "mcp": ["*"]}
    keys = [{"name": "admin", "sha256": hash_key(ADMIN), "admin": True}, user]
    keys_path.write_text(yaml.safe_dump({"keys": keys}))
    config = {
        "manager": {"auto_discover": False},
        "mcp": {
            "max_turns": MAX_TURNS,
            "total_timeout_s": 60,
            "servers": [
                files_server(notes),
                {"label": "web", "url": http_server, "allowed_tools": ["add"]},
                # A server that cannot start: reported, never fatal to the gateway.
                {"label": "broken", "command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]},
            ],
        },
        "models": [
            {"name": "echo", "engine": "echo", "chat": {"tool_parser": "hermes"}, "preload": True},
            {"name": "echo-files", "engine": "echo", "chat": {"tool_parser": "hermes"}, "mcp_servers": ["files"]},
            {"name": "echo-broken", "engine": "echo", "chat": {"tool_parser": "hermes"}, "mcp_servers": ["broken"]},
        ],
    }
    gw = start_gateway(home, config, "mcp-gateway", extra_args=("--keys", str(keys_path)))
    wait_for(lambda: servers(gw)["files"]["state"] == servers(gw)["web"]["state"] == "ready", timeout=60)
    yield gw
    gw.stop()


def get(gw, path: str, key: str = USER):
    return http(f"{gw.url}{path}", headers={"Authorization": f"Bearer {key}"})


def servers(gw) -> dict:
    return {s["label"]: s for s in get(gw, "/v1/mcp/servers")[2]["data"]}


def execute(gw, body: dict, key: str = ADMIN, timeout: float = 60):
    return http(f"{gw.url}/v1/mcp/execute", "POST", body, {"Authorization": f"Bearer {key}"}, timeout=timeout)


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=USER, max_retries=0)


def test_tools_lists_the_allow_listed_tools_of_every_server(gw):
    status, _, body = get(gw, "/v1/mcp/tools")
    assert status == 200
    listed = {(t["server_label"], t["name"]) for t in body["data"]}
    # delete_everything is on neither allow-list; "web" allows add only.
    assert listed == {("files", "add"), ("files", "read_note"), ("files", "hang"), ("web", "add")}
    add = next(t for t in body["data"] if t["name"] == "add")
    assert set(add["input_schema"]["properties"]) == {"a", "b"}


def test_servers_report_state_transport_tool_count_and_last_error(gw):
    files = servers(gw)["files"]
    assert (files["state"], files["transport"], files["tool_count"]) == ("ready", "stdio", 3)
    web = servers(gw)["web"]
    assert (web["state"], web["transport"], web["tool_count"]) == ("ready", "streamable-http", 1)
    broken = wait_for(lambda: servers(gw)["broken"]["last_error"] and servers(gw)["broken"])
    assert broken["state"] in ("failed", "connecting")
    assert broken["tool_count"] == 0


def test_health_reports_mcp_status(gw):
    status, _, body = http(f"{gw.url}/health", headers={"Authorization": f"Bearer {ADMIN}"})  # an admin's view
    assert status == 200
    assert body["status"] == "ok"
    assert body["mcp"]["files"] == "ready"
    assert body["mcp"]["broken"] in ("failed", "connecting")


def test_execute_runs_a_tool_for_an_admin_key(gw):
    status, _, body = execute(gw, {"server_label": "files", "name": "read_note", "arguments": {"name": "today.txt"}})
    assert status == 200, body
    assert (body["output"], body["error"]) == (NOTE, None)


def test_execute_on_a_server_that_is_down_is_a_503(gw):
    status, _, body = execute(gw, {"server_label": "broken", "name": "add"})
    assert status == 503
    assert "MCP server 'broken'" in body["error"]["message"]


def test_execute_needs_an_admin_key(gw):
    status, _, body = execute(gw, {"server_label": "files", "name": "add", "arguments": {"a": 1, "b": 2}}, key=USER)
    assert status == 403
    assert body["error"]["type"] == "permission_error"


def test_execute_refuses_a_tool_not_on_the_allow_list(gw, notes):
    status, _, body = execute(gw, {"server_label": "files", "name": "delete_everything"})
    assert status == 400
    assert "not allowed" in body["error"]["message"]
    assert not (notes / "deleted").exists()


def test_execute_of_a_hanging_tool_times_out_within_the_configured_timeout(gw):
    started = time.monotonic()
    status, _, body = execute(gw, {"server_label": "files", "name": "hang"})
    elapsed = time.monotonic() - started
    assert status == 504
    assert "timed out after 2 s" in body["error"]["message"]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10
    # The server is not wedged by the call it abandoned.
    assert execute(gw, {"server_label": "files", "name": "add", "arguments": {"a": 1, "b": 2}})[2]["output"] == "3"


def test_chat_runs_an_mcp_tool_and_continues_to_the_answer(gw):
    out = client(gw).chat.completions.create(model="echo", messages=ask(call("add", a=2, b=3)), tools=FILES)
    choice = out.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("5", "stop")
    assert not choice.message.tool_calls
    (ran,) = choice.message.model_extra["mlxgw_mcp_calls"]
    assert (ran["server_label"], ran["name"], json.loads(ran["arguments"]), ran["output"]) == (
        "files",
        "add",
        {"a": 2, "b": 3},
        "5",
    )
    assert out.usage.completion_tokens > 1  # both turns are counted


def test_chat_streams_the_mcp_call_and_its_result(gw):
    stream = client(gw).chat.completions.create(
        model="echo", messages=ask(call("add", a=20, b=22)), tools=FILES, stream=True
    )
    chunks = [c for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    shown = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.function.name, tc.model_extra["mlxgw_mcp"]["server_label"]) for tc in shown] == [("add", "files")]
    results = [d.model_extra["mlxgw_mcp_result"] for d in deltas if d.model_extra.get("mlxgw_mcp_result")]
    assert [(r["name"], r["output"], r["id"]) for r in results] == [("add", "42", shown[0].id)]
    assert "".join(d.content or "" for d in deltas) == "42"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_responses_runs_an_mcp_tool_as_an_mcp_call_item(gw):
    out = client(gw).responses.create(model="echo", input=call("read_note", name="today.txt"), tools=FILES)
    assert [item.type for item in out.output] == ["mcp_call", "message"]
    mcp_call = out.output[0]
    assert (mcp_call.server_label, mcp_call.name, mcp_call.output, mcp_call.error) == ("files", "read_note", NOTE, None)
    assert out.output_text == NOTE
    assert out.status == "completed"


def test_responses_streams_mcp_call_items(gw):
    events = list(client(gw).responses.create(model="echo", input=call("add", a=1, b=1), tools=FILES, stream=True))
    kinds = [e.type for e in events]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added[0].type == "mcp_call" and added[0].status == "in_progress"
    assert "response.mcp_call.completed" in kinds
    assert (done[0].type, done[0].name, done[0].server_label, done[0].output) == ("mcp_call", "add", "files", "2")
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["mcp_call", "message"]
    assert final.output_text == "2"


def test_a_streamable_http_server_runs_tools_in_the_loop(gw):
    tools = [{"type": "mcp", "server_label": "web"}]
    out = client(gw).chat.completions.create(model="echo", messages=ask(call("add", a=3, b=4)), tools=tools)
    assert out.choices[0].message.content == "7"
    assert out.choices[0].message.model_extra["mlxgw_mcp_calls"][0]["server_label"] == "web"


def test_naming_two_servers_with_the_same_tool_name_is_a_400(gw):
    tools = [{"type": "mcp", "server_label": "files"}, {"type": "mcp", "server_label": "web"}]
    with pytest.raises(openai.BadRequestError) as err:
        client(gw).chat.completions.create(model="echo", messages=ask("hi"), tools=tools)
    assert "offered twice" in err.value.body["message"]


def test_a_hanging_tool_becomes_an_error_result_within_the_timeout(gw):
    started = time.monotonic()
    out = client(gw).chat.completions.create(model="echo", messages=ask(call("hang")), tools=FILES)
    elapsed = time.monotonic() - started
    (ran,) = out.choices[0].message.model_extra["mlxgw_mcp_calls"]
    assert "timed out after 2 s" in ran["error"]
    assert out.choices[0].message.content.startswith("error: ")  # the model was told, and answered
    assert elapsed < TIMEOUT_S + 10


def test_a_hanging_tool_ends_a_stream_cleanly(gw):
    stream = client(gw).responses.create(model="echo", input=call("hang"), tools=FILES, stream=True)
    events = list(stream)
    failed = [e for e in events if e.type == "response.mcp_call.failed"]
    assert len(failed) == 1
    assert events[-1].type == "response.completed"
    assert "timed out" in events[-1].response.output[0].error


def test_a_tool_not_on_the_allow_list_is_never_run(gw, notes):
    out = client(gw).chat.completions.create(model="echo", messages=ask(call("delete_everything")), tools=FILES)
    assert "mlxgw_mcp_calls" not in out.choices[0].message.model_extra
    assert not (notes / "deleted").exists()


def test_unknown_server_label_is_a_400_in_each_apis_shape(gw):
    bad = [{"type": "mcp", "server_label": "nope"}]
    with pytest.raises(openai.BadRequestError) as chat:
        client(gw).chat.completions.create(model="echo", messages=ask("hi"), tools=bad)
    with pytest.raises(openai.BadRequestError) as responses:
        client(gw).responses.create(model="echo", input="hi", tools=bad)
    for err in (chat.value, responses.value):
        assert "unknown MCP server_label 'nope'" in err.body["message"]
        assert err.body["param"] == "tools"


def test_a_server_that_is_down_is_a_clear_error_for_that_request(gw):
    tools = [{"type": "mcp", "server_label": "broken"}]
    with pytest.raises(openai.APIStatusError) as err:
        client(gw).chat.completions.create(model="echo", messages=ask("hi"), tools=tools)
    assert err.value.status_code == 503
    assert "MCP server 'broken'" in err.value.body["message"]


def test_calling_a_client_tool_returns_the_turn_to_the_client(gw):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = client(gw).chat.completions.create(
        model="echo", messages=ask(call("get_weather", city="Paris")), tools=[*FILES, weather]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert "mlxgw_mcp_calls" not in choice.message.model_extra


def test_mcp_calls_beside_a_client_call_are_run_and_not_handed_to_the_client(gw):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = call("add", a=1, b=2) + call("get_weather", city="Paris")
    out = client(gw).chat.completions.create(model="echo", messages=ask(text), tools=[*FILES, weather])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert [(c["name"], c["output"]) for c in choice.message.model_extra["mlxgw_mcp_calls"]] == [("add", "3")]


def test_a_models_default_server_that_is_down_does_not_stop_the_model(gw):
    out = client(gw).chat.completions.create(model="echo-broken", messages=ask("still here"))
    assert out.choices[0].message.content == "still here"


def test_the_models_default_servers_are_offered_without_naming_them(gw):
    out = client(gw).chat.completions.create(model="echo-files", messages=ask(call("add", a=4, b=5)))
    assert out.choices[0].message.content == "9"


def test_the_loop_stops_after_max_turns_and_the_model_answers(gw):
    out = client(gw).chat.completions.create(
        model="echo", messages=ask(call("read_note", name="loop.txt")), tools=FILES
    )
    ran = out.choices[0].message.model_extra["mlxgw_mcp_calls"]
    assert len(ran) == MAX_TURNS
    assert out.choices[0].finish_reason == "stop"  # the tools were withdrawn: the model answered
    assert "read_note" in out.choices[0].message.content


def test_a_server_process_that_dies_is_reconnected(gw):
    (pid,) = mcp_server_pids(gw)
    before = servers(gw)["files"]["connect_attempts"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: servers(gw)["files"]["connect_attempts"] > before and servers(gw)["files"]["state"] == "ready", 60)
    assert mcp_server_pids(gw) != [pid]
    assert execute(gw, {"server_label": "files", "name": "add", "arguments": {"a": 2, "b": 2}})[2]["output"] == "4"


def test_stopping_the_gateway_stops_its_mcp_servers(home, notes):
    config = {"manager": {"auto_discover": False}, "mcp": {"servers": [files_server(notes)]}, "models": []}
    gw = start_gateway(home, config, "mcp-stop-gateway")
    try:
        pids = wait_for(lambda: mcp_server_pids(gw))
        wait_for(lambda: http(f"{gw.url}/health")[2]["mcp"]["files"] == "ready", 60)
    finally:
        assert gw.stop() == 0
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


@pytest.mark.parametrize(
    ("mcp", "models", "message"),
    [
        ({"servers": [{"label": "a", "command": "x", "timeout": 3}]}, [], "unknown field 'timeout'"),
        ({"servers": [{"label": "a", "command": "x", "url": "http://127.0.0.1:1/mcp"}]}, [], "either 'command'"),
        ({"servers": [{"label": "a"}]}, [], "either 'command'"),
        ({"servers": [{"label": "a", "command": "x", "env": {"A": 1}}]}, [], "field 'env'"),
        ({"servers": [{"label": "a b", "command": "x"}]}, [], "field 'label'"),
        ({"servers": [{"label": "a", "command": "x"}, {"label": "a", "command": "y"}]}, [], "duplicate"),
        ({"servers": []}, [{"name": "m", "mcp_servers": ["nope"]}], "no MCP server labelled 'nope'"),
    ],
)
def test_models_yaml_mcp_mistakes_are_errors_that_name_the_field(mcp, models, message):
    with pytest.raises(ConfigError, match=message):
        parse_registry({"mcp": mcp, "models": models})
