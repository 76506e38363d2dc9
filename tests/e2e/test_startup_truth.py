"""Start-up and its lines tell the truth: a line per preloaded model when
it is ready, then the ready line; the echo engine one flag away (`mlxgw up --echo`), whose
repeated fenced JSON call comes back as a call; two gateways on one MLXGW_HOME keep their run
files apart; /v1/models?kind=chat lists what a chat UI can use. Real `mlxgw up` processes."""

from __future__ import annotations

import json

import pytest
from helpers import http, openai_client, start_gateway

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def two_gateways(home, tiny_dir):
    """Two gateways on the same MLXGW_HOME: an echo-only one and one with a tiny chat model
    and an embedding-kind entry (never loaded here)."""
    from mlxgw.shared import paths

    first = start_gateway(
        home, {"manager": {"auto_discover": False}, "models": []}, "echo-only", extra_args=("--echo",)
    )
    # A run file of the first gateway that a connect cannot prove alive (it is busy, paused,
    # or its listener is not up yet): the second gateway's start-up must leave it alone.
    busy = paths.run_dir() / f"gateway-{first.proc.pid}-feedbeef.sock"
    busy.write_text("")
    second = start_gateway(
        home,
        {
            "manager": {"auto_discover": False},
            "models": [
                {"name": "startup-tiny", "source": "tiny", "preload": True},
                {"name": "startup-embed", "source": "tiny", "kind": "embedding"},
            ],
        },
        "startup-second",
        extra_args=("--echo",),
    )
    yield first, second, busy
    second.stop()
    first.stop()
    busy.unlink(missing_ok=True)


def test_each_preloaded_model_is_announced_before_the_ready_line(two_gateways):
    _, gw, _ = two_gateways
    lines = gw.log().splitlines()
    ready = next(i for i, line in enumerate(lines) if line.startswith("mlxgw ready on"))
    announced = [i for i, line in enumerate(lines) if line.startswith("mlxgw: model startup-tiny ready in")]
    assert announced and announced[0] < ready, lines
    assert lines[ready] == f"mlxgw ready on {gw.url}"  # nothing left loading


def test_the_echo_engine_is_one_flag_away_and_a_fenced_call_it_repeats_is_a_call(two_gateways):
    gw, _, _ = two_gateways
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    out = openai_client(gw).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": fenced}], tools=TOOLS, max_tokens=200
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    mention = openai_client(gw).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "Use get_weather for Oslo."}], tools=TOOLS, max_tokens=200
    )
    assert mention.choices[0].finish_reason == "stop" and mention.choices[0].message.content  # a mention stays text


def test_two_gateways_on_one_home_keep_their_run_files_apart(two_gateways):
    """The second gateway's start-up cleaning left the first one's run files alone."""
    first, _, busy = two_gateways
    assert busy.exists()
    assert (
        openai_client(first)
        .chat.completions.create(model="echo", messages=[{"role": "user", "content": "still here"}], max_tokens=5)
        .choices[0]
        .message.content
    )


def test_models_can_be_listed_by_kind_for_chat_uis(two_gateways):
    _, gw, _ = two_gateways
    everything = {m["id"]: m["kind"] for m in http(f"{gw.url}/v1/models")[2]["data"]}
    assert everything["startup-embed"] == "embedding"
    chat = {m["id"] for m in http(f"{gw.url}/v1/models?kind=chat")[2]["data"]}
    assert chat == {"startup-tiny", "echo"}
