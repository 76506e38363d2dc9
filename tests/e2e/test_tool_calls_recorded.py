"""The tool calls real small models make, read as the worker reads them.

tests/fixtures/tool_call_outputs.json holds real greedy answers of Qwen2.5-Coder-0.5B (its own
hermes-style template with tools) and SmolLM2-135M (the generic tool instruction), to tasks
offered the tools of the recorded agent requests (Claude Code's Write and Bash, Codex's
exec_command; bench/agents/record_tool_outputs.py made it). Qwen answers with a call in a
```json fence, which was returned as text before; SmolLM2 answers with prose and Python
code, which must stay text. Each answer is streamed through the parser of every template
family in small pieces, as the worker feeds it. The live end-to-end checks (SmolLM2 here,
Qwen in test_gguf_archs.py) use the same recorded tools."""

from __future__ import annotations

import json

import pytest
from helpers import FIXTURES

from mlxgw.worker.text.output_parser import OutputParser, tool_syntax

FIXTURE = FIXTURES / "tool_call_outputs.json"
RECORDED = json.loads(FIXTURE.read_text())
FAMILIES = ["hermes", "generic", "llama3_json", "mistral", "deepseek", "qwen3_coder"]


def _parse(family: str, tools: list[dict], text: str, piece: int = 3) -> tuple[str, list[tuple[str, dict]]]:
    parser = OutputParser(tool=tool_syntax(family, None), tools=tools)
    out = []
    for i in range(0, len(text), piece):
        out.append(parser.feed(text[i : i + piece]))
    out.append(parser.finish())
    calls = [(c["name"], json.loads(c["arguments"])) for o in out for c in o.tool_calls]
    return "".join(o.text for o in out), calls


def _case(model: str, case: str) -> dict:
    return next(r for r in RECORDED if r["model"] == model and r["case"] == case)


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen_coders_fenced_write_call_is_a_tool_call_in_every_family(family):
    rec = _case("qwen2.5-coder-0.5b", "claude_code_write")
    assert rec["output"].startswith("```json")  # what the model really wrote
    text, calls = _parse(family, rec["tools"], rec["output"])
    assert text.strip() == ""
    assert [name for name, _ in calls] == ["Write"]
    assert set(calls[0][1]) == {"file_path", "content"}


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen_coders_fenced_bash_call_is_a_tool_call_in_every_family(family):
    rec = _case("qwen2.5-coder-0.5b", "claude_code_bash")
    text, calls = _parse(family, rec["tools"], rec["output"])
    assert text.strip() == "" and calls[0][0] == "Bash" and calls[0][1]["command"] == "ls"


def test_a_call_cut_before_its_json_ends_stays_text():
    """The exec_command answer was cut at the recording's 80 tokens, inside its JSON."""
    rec = _case("qwen2.5-coder-0.5b", "codex_exec_command")
    text, calls = _parse("hermes", rec["tools"], rec["output"])
    assert calls == [] and text == rec["output"]


def test_the_same_call_naming_a_tool_not_offered_stays_text():
    rec = _case("qwen2.5-coder-0.5b", "claude_code_write")
    other = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
    text, calls = _parse("hermes", other, rec["output"])
    assert calls == [] and text == rec["output"]


@pytest.mark.parametrize("case", ["claude_code_write", "claude_code_bash", "codex_exec_command"])
def test_smollm2s_prose_and_code_stay_text(case):
    rec = _case("smollm2-135m", case)
    for family in FAMILIES:
        text, calls = _parse(family, rec["tools"], rec["output"])
        assert calls == [] and text == rec["output"], family


def test_a_list_of_calls_and_openais_own_shape_are_calls():
    tools = _case("qwen2.5-coder-0.5b", "claude_code_bash")["tools"]
    listed = '[{"name": "Bash", "arguments": {"command": "ls"}}, {"name": "Bash", "arguments": {"command": "pwd"}}]'
    assert [a["command"] for _, a in _parse("generic", tools, listed)[1]] == ["ls", "pwd"]
    shaped = '{"type": "function", "function": {"name": "Bash", "arguments": "{\\"command\\": \\"ls\\"}"}}'
    assert _parse("hermes", tools, shaped)[1] == [("Bash", {"command": "ls"})]


def test_smollm2_on_the_recorded_write_tool_through_the_gateway(real_gateway):
    """The real default model, served, offered Claude Code's recorded Write tool: whatever
    it answers reaches the client whole, as text or as a call of that tool, never markup."""
    from helpers import openai_client

    rec = _case("smollm2-135m", "claude_code_write")
    out = openai_client(real_gateway, timeout=120).chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": rec["task"]}],
        tools=rec["tools"],
        max_tokens=24,
        temperature=0,
    )
    choice = out.choices[0]
    calls = choice.message.tool_calls or []
    assert all(c.function.name == "Write" for c in calls)
    assert "```json" not in (choice.message.content or "") and "<tool_call>" not in (choice.message.content or "")
    assert choice.finish_reason in ("tool_calls", "stop", "length")
