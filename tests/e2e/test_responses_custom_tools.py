"""Custom (freeform) tools and Codex's `additional_tools` item in the Responses API, through
the official openai SDK against a real gateway: offered to the model as a function with one
string parameter `input`, called back as `custom_tool_call` items (streamed with
`response.custom_tool_call_input.*` events), answered with `custom_tool_call_output`."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import FIXTURES, http, openai_client

SCRIPT = 'const x = 1;\nconsole.log("two" + x);'
RUN_JS = {"type": "custom", "name": "run_js", "description": "Run JavaScript"}


def markup(name: str, **arguments) -> str:
    """Tool-call markup the echo model repeats as a call."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


CALL = markup("run_js", input=SCRIPT)


def codex_additional_tools_item() -> dict:
    """The `additional_tools` item Codex 0.171.0 sends with its default model (recorded)."""
    body = json.loads((FIXTURES / "codex_default_model_request.json").read_text())
    return next(i for i in body["input"] if i.get("type") == "additional_tools")


def test_a_custom_tool_call_comes_back_as_a_custom_tool_call_item(tiny_gateway):
    r = openai_client(tiny_gateway).responses.create(model="echo", input="Running it." + CALL, tools=[RUN_JS])
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "run_js" and call.input == SCRIPT and call.call_id and call.namespace is None
    assert r.output_text == "Running it." and not [o for o in r.output if o.type == "function_call"]


def test_a_custom_tool_call_streams_as_openai_streams_it(tiny_gateway):
    events = list(openai_client(tiny_gateway).responses.create(model="echo", input=CALL, tools=[RUN_JS], stream=True))
    types = [e.type for e in events]
    assert types[2:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "custom_tool_call" and added.item.input == ""
    assert delta.item_id == done.item_id == added.item.id and delta.delta == done.input == SCRIPT
    assert item_done.item.input == SCRIPT and item_done.item.call_id == added.item.call_id
    (final,) = [o for o in events[-1].response.output if o.type == "custom_tool_call"]
    assert final.input == SCRIPT


def test_the_sdk_stream_helper_assembles_the_custom_tool_call(tiny_gateway):
    with openai_client(tiny_gateway).responses.stream(model="echo", input=CALL, tools=[RUN_JS]) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "custom_tool_call" and call.input == SCRIPT


def test_custom_tool_call_output_is_the_tool_result_of_the_next_turn(tiny_gateway):
    client = openai_client(tiny_gateway)
    first = client.responses.create(model="echo", input=CALL, tools=[RUN_JS])
    (call,) = first.output
    follow = client.responses.create(
        model="echo",
        tools=[RUN_JS],
        input=[
            {"role": "user", "content": CALL},
            {"type": "custom_tool_call", "call_id": call.call_id, "name": "run_js", "input": call.input},
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "two1"},
        ],
    )
    assert follow.output_text == "two1"
    # the same through previous_response_id, with the output as a list of content parts
    output = [{"type": "input_text", "text": "two1 again"}]
    again = client.responses.create(
        model="echo",
        tools=[RUN_JS],
        previous_response_id=first.id,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": output}],
    )
    assert again.output_text == "two1 again"


def test_tools_in_codex_additional_tools_item_are_offered(tiny_gateway):
    item = codex_additional_tools_item()
    calls = markup("functions__exec", input="text(1)") + markup("functions__wait", cell_id="1")
    r = openai_client(tiny_gateway).responses.create(model="echo", input=[item, {"role": "user", "content": calls}])
    custom, function = r.output
    assert (custom.type, custom.namespace, custom.name, custom.input) == (
        "custom_tool_call",
        "functions",
        "exec",
        "text(1)",
    )
    assert (function.type, function.namespace, function.name) == ("function_call", "functions", "wait")


def test_a_forced_custom_tool_call_matches_its_regex_format(tiny_gateway):
    tool = {**RUN_JS, "name": "answer", "format": {"type": "grammar", "syntax": "regex", "definition": "(yes|no)!"}}
    r = openai_client(tiny_gateway).responses.create(
        model="tiny",
        input="Answer.",
        tools=[tool],
        tool_choice={"type": "custom", "name": "answer"},
        max_output_tokens=64,
    )
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "answer" and call.input in ("yes!", "no!")


def test_a_custom_tool_with_a_lark_format_is_accepted_and_described(tiny_gateway):
    lark = codex_additional_tools_item()["tools"][0]["tools"][0]["format"]
    client = openai_client(tiny_gateway)
    plain = client.responses.create(model="tiny", input="hi", tools=[RUN_JS], max_output_tokens=1)
    with_grammar = client.responses.create(
        model="tiny", input="hi", tools=[{**RUN_JS, "format": lark}], max_output_tokens=1
    )
    # the grammar is shown to the model in the tool's description (not enforced: see README)
    assert with_grammar.usage.input_tokens > plain.usage.input_tokens + 20


@pytest.mark.parametrize(
    "tools,extra,param",
    [
        ([{"type": "custom"}], {}, "tools"),
        ([{"type": "custom", "name": ""}], {}, "tools"),
        ([{**RUN_JS, "format": {"type": "json"}}], {}, "tools"),
        ([{**RUN_JS, "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}], {}, "tools"),
        ([{**RUN_JS, "format": {"type": "grammar", "syntax": "lark"}}], {}, "tools"),
        ([{"type": "namespace", "name": "ns"}], {}, "tools"),
        ([RUN_JS], {"tool_choice": {"type": "custom"}}, "tool_choice"),
        (None, {"input": [{"type": "additional_tools", "role": "developer"}]}, "input"),
        (None, {"input": [{"type": "additional_tools", "tools": [{"type": "custom"}]}]}, "tools"),
    ],
)
def test_bad_custom_tool_shapes_are_400_in_openai_shape(tiny_gateway, tools, extra, param):
    body = {"model": "echo", "input": "x", **({"tools": tools} if tools else {}), **extra}
    status, _, payload = http(f"{tiny_gateway.url}/v1/responses", "POST", body)
    assert status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["param"] == param


def test_the_sdk_raises_bad_request_for_a_bad_custom_tool(tiny_gateway):
    with pytest.raises(openai.BadRequestError, match="format"):
        openai_client(tiny_gateway).responses.create(
            model="echo",
            input="x",
            tools=[{**RUN_JS, "format": {"type": "grammar", "syntax": "ebnf", "definition": ""}}],
        )


# -- Codex's code-mode prompt on the quick-start model -----------------------------------


def test_codex_code_mode_prompt_with_its_tools_fits_the_quick_start_context(smollm2_dir):
    """Codex's default-model prompt is ~7,200 tokens on SmolLM2 before its 12 tools; even the
    compact tool listing (8,470) would not fit the 8,192-token context, so the minimal one
    (names and argument types) is used and the request is served."""
    from mlx_lm.utils import load_tokenizer

    from mlxgw.gateway.api.responses.responses import parse
    from mlxgw.gateway.api.responses.tools import parse_tools
    from mlxgw.gateway.pipeline.content import ContentPolicy
    from mlxgw.shared.protocol import GenerateRequest
    from mlxgw.worker.text.chat_text import ChatText

    body = json.loads((FIXTURES / "codex_default_model_request.json").read_text())
    parsed = parse(body, [], ContentPolicy(None), parse_tools(body.get("tools"), body["input"]))
    tokenizer = load_tokenizer(smollm2_dir)
    text = ChatText(tokenizer, tokenizer.vocab_size, tool_parser="generic", context_length=8192)
    ids = text.encode(GenerateRequest(rid="r", messages=parsed.messages, tools=parsed.tools))
    assert len(ids) < 8192 - 256
    prompt = tokenizer.decode(ids)
    assert '{"name": "functions__exec", "arguments": {"input": "string"}}' in prompt


def test_a_forced_call_may_name_a_namespaced_custom_tool_without_its_namespace(tiny_gateway):
    tool = {**RUN_JS, "name": "answer", "format": {"type": "grammar", "syntax": "regex", "definition": "ok"}}
    r = openai_client(tiny_gateway).responses.create(
        model="tiny",
        input="Answer.",
        tools=[{"type": "namespace", "name": "functions", "description": "", "tools": [tool]}],
        tool_choice={"type": "custom", "name": "answer"},
        max_output_tokens=64,
    )
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert (call.namespace, call.name, call.input) == ("functions", "answer", "ok")
