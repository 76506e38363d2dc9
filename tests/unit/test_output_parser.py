"""The output parser on recorded model outputs, fed whole and split at every position."""

from __future__ import annotations

import json

import pytest

from mlxgw.worker.text.output_parser import OutputParser, tool_syntax


def hermes():
    return tool_syntax("hermes", None)


def run(parser_factory, text: str, cut: int | None = None):
    parser = parser_factory()
    pieces = [text] if cut is None else [text[:cut], text[cut:]]
    out = None
    for piece in pieces:
        got = parser.feed(piece)
        out = got if out is None else (out.extend(got) or out)
    out.extend(parser.finish())
    return out, parser


QWEN_TOOL = (
    'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
THINKING = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"


@pytest.mark.parametrize("cut", [None, *range(len(QWEN_TOOL) + 1)])
def test_hermes_tool_calls_at_every_split(cut):
    out, parser = run(lambda: OutputParser(tool=hermes()), QWEN_TOOL, cut)
    assert out.text.strip() == "I will check."
    assert [c["name"] for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert [c["index"] for c in out.tool_calls] == [0, 1]
    assert "<tool_call>" not in out.text and parser.saw_tool_calls


@pytest.mark.parametrize("cut", [None, *range(len(THINKING) + 1)])
def test_reasoning_is_split_from_the_answer_at_every_split(cut):
    out, _ = run(lambda: OutputParser(think=("<think>", "</think>")), THINKING, cut)
    assert out.reasoning.strip() == "The user wants a greeting."
    assert out.text == "Hello there!"


def test_template_that_opens_the_think_tag_starts_in_reasoning():
    out, _ = run(lambda: OutputParser(think=("<think>", "</think>"), in_reasoning=True), "planning...</think>\n\nDone.")
    assert out.reasoning == "planning..." and out.text == "Done."


def test_malformed_tool_markup_stays_text_and_is_not_a_call():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    out, parser = run(lambda: OutputParser(tool=hermes()), bad)
    assert out.tool_calls == [] and not parser.saw_tool_calls
    assert "{not json}" in out.text


def test_unterminated_reasoning_is_flushed_as_reasoning():
    out, _ = run(lambda: OutputParser(think=("<think>", "</think>")), "<think>still thinking when max_tokens hit")
    assert out.reasoning == "still thinking when max_tokens hit" and out.text == ""


def test_mistral_calls_run_to_the_end_of_output():
    text = 'Sure. [TOOL_CALLS][{"name": "search", "arguments": {"q": "mlx"}}]'
    out, _ = run(lambda: OutputParser(tool=tool_syntax("mistral", None)), text)
    assert out.text.strip() == "Sure."
    assert out.tool_calls[0]["name"] == "search" and json.loads(out.tool_calls[0]["arguments"]) == {"q": "mlx"}


def test_text_without_markup_passes_through_unchanged():
    text = "Plain answer with < and > and <tool and <thi characters."
    for cut in range(len(text) + 1):
        out, _ = run(lambda: OutputParser(think=("<think>", "</think>"), tool=hermes()), text, cut)
        assert out.text == text and not out.tool_calls and not out.reasoning


LLAMA3_BARE = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
LLAMA3_TAGGED = 'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
DEEPSEEK = (
    "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


@pytest.mark.parametrize("text,prefix", [(LLAMA3_BARE, ""), (LLAMA3_TAGGED, "Let me look."), (DEEPSEEK, "Checking.")])
def test_llama3_and_deepseek_calls_at_every_split(text, prefix):
    family = "deepseek" if "tool▁sep" in text else "llama3_json"
    for cut in [None, *range(len(text) + 1)]:
        out, _ = run(lambda family=family: OutputParser(tool=tool_syntax(family, None)), text, cut)
        assert out.text == prefix
        (call,) = out.tool_calls
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}


def test_llama3_plain_answers_are_not_calls():
    for text in ('{"answer": 42}', "The name is Bond."):
        out, _ = run(lambda: OutputParser(tool=tool_syntax("llama3_json", None)), text)
        assert out.text == text and not out.tool_calls


# -- the generic format (templates without a tool format of their own) -------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
GENERIC_TOOL = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def generic():
    return tool_syntax("generic", None)


class _NoToolTokenizer:  # what mlx-lm's TokenizerWrapper says about a template without tools
    tool_call_start = None
    tool_parser = None


def test_template_without_tool_format_gets_the_generic_format():
    assert tool_syntax(None, _NoToolTokenizer()).start == "<tool_call>"
    assert tool_syntax("auto", _NoToolTokenizer()).chat_messages is not None
    assert tool_syntax("none", _NoToolTokenizer()) is None


@pytest.mark.parametrize("cut", [None, *range(len(GENERIC_TOOL) + 1)])
def test_generic_tool_call_at_every_split(cut):
    out, parser = run(lambda: OutputParser(tool=generic(), tools=[WEATHER]), GENERIC_TOOL, cut)
    assert out.text == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_generic_bare_json_call_of_an_offered_tool_is_a_call():
    out, _ = run(lambda: OutputParser(tool=generic(), tools=[WEATHER]), '{"name": "get_weather", "arguments": {}}')
    assert out.text == "" and out.tool_calls[0]["name"] == "get_weather"


def test_generic_json_naming_no_offered_tool_stays_text():
    answer = '{"name": "Ada", "arguments": {"age": 36}}'
    out, parser = run(lambda: OutputParser(tool=generic(), tools=[WEATHER]), answer)
    assert out.text == answer and not parser.saw_tool_calls


def test_generic_list_of_calls_in_one_block():
    calls = [{"name": "get_weather", "arguments": {}}, {"name": "get_weather", "arguments": {"a": 1}}]
    text = f"<tool_call>{json.dumps(calls)}</tool_call>"
    out, _ = run(lambda: OutputParser(tool=generic(), tools=[WEATHER]), text)
    assert [c["index"] for c in out.tool_calls] == [0, 1]


def test_generic_messages_describe_tools_and_replay_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    out = generic().chat_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert out[3]["content"] == '<tool_response name="get_weather">\nsunny\n</tool_response>\n\nAnd tomorrow?'
    assert all("tool_calls" not in m for m in out)


def test_generic_messages_keep_images_of_tool_results():
    image = {"type": "image"}
    messages = [{"role": "user", "content": "Look"}, {"role": "tool", "tool_call_id": "x", "content": [image]}]
    out = generic().chat_messages(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[1]["role"] == "user"
    assert image in out[1]["content"] and out[1]["content"][0] == {"type": "text", "text": "Look"}


def test_generic_compact_listing_keeps_names_and_types_but_drops_prose():
    tool = {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Runs a command.\n\nA long manual follows. " * 20,
            "parameters": {
                "type": "object",
                "$schema": "http://json-schema.org/draft-07/schema#",
                "properties": {"command": {"type": "string", "description": "The command. " * 30}},
                "required": ["command"],
            },
        },
    }
    full = generic().chat_messages([{"role": "user", "content": "hi"}], [tool])[0]["content"]
    compact = generic().chat_messages([{"role": "user", "content": "hi"}], [tool], compact=True)[0]["content"]
    assert len(compact) < len(full) // 3
    listing = json.loads(next(line for line in compact.splitlines() if line.startswith('{"name": "Bash"')))
    assert listing == {
        "name": "Bash",
        "description": "Runs a command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    }


class _HermesTokenizer:
    tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"

    @staticmethod
    def tool_parser(text, tools=None):
        return json.loads(text.strip())


def test_hermes_template_bare_json_naming_an_offered_tool_is_a_call():
    """Qwen2.5-Coder-0.5B (imported from GGUF) answers a tool request with the bare object."""
    answer = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    out, _ = run(lambda: OutputParser(tool=tool_syntax(None, _HermesTokenizer()), tools=[WEATHER]), answer)
    assert out.text == "" and [(c["name"], json.loads(c["arguments"])) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_hermes_template_bare_json_without_offered_tools_stays_text():
    answer = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for tools in (None, [{"type": "function", "function": {"name": "other"}}]):
        out, parser = run(lambda t=tools: OutputParser(tool=tool_syntax(None, _HermesTokenizer()), tools=t), answer)
        assert out.text == answer and not parser.saw_tool_calls
