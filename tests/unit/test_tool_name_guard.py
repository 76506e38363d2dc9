"""The tool-name guard (worker/text/tool_name_guard.py) with the real SmolLM2 tokenizer and the
real llguidance matcher: once a call's name opens, only offered names can be written; prose
and JSON elsewhere are left alone; the model's own choice among offered names is kept."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from mlxgw.shared.protocol import GenerateRequest

TOOLS = [
    {"type": "function", "function": {"name": "Write", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}},
    {"name": "exec_command", "parameters": {"type": "object"}},  # the flat (Responses) shape
]


@pytest.fixture(scope="module")
def text(smollm2_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxgw.worker.text.chat_text import ChatText

    tokenizer = load_tokenizer(smollm2_dir)
    return ChatText(tokenizer, tokenizer.vocab_size, tool_name_guard=True)


def request(**kw) -> GenerateRequest:
    return GenerateRequest(rid="r", messages=[{"role": "user", "content": "hi"}], **kw)


def decode_greedy(text, guard, answer_so_far: str, prefer: str, steps: int = 12) -> str:
    """Feed answer_so_far token by token, then decode greedily through the guard from logits
    that favour whatever continues `prefer` from the text written so far (a model that
    "wants" to write prefer); return what was written after answer_so_far."""
    tok = text.tokenizer
    vocab = text.vocab_size
    tokens = [tok.bos_token_id or 0]
    for t in tok.encode(answer_so_far, add_special_tokens=False):
        guard(mx.array(tokens), mx.zeros((1, vocab)))  # each token is seen one step after it is sampled
        tokens.append(t)
    out: list[int] = []
    for _ in range(steps):
        logits = mx.zeros((1, vocab))
        written = tok.decode(out)
        if prefer.startswith(written) and len(prefer) > len(written):
            logits[0, tok.encode(prefer[len(written) :], add_special_tokens=False)[0]] = 50.0
        token = int(mx.argmax(guard(mx.array(tokens), logits), axis=-1).item())
        tokens.append(token)
        out.append(token)
    return tok.decode(out)


@pytest.mark.parametrize(
    "opening",
    [
        '{"name": "',  # a bare JSON answer
        'I will write the file.\n```json\n{"name": "',  # a fenced call after some prose
        '<tool_call>\n{"name": "',  # the model's own markup
        '{"type": "function", "function": {"name": "',  # OpenAI's shape
    ],
)
def test_an_invented_name_becomes_an_offered_one(text, opening):
    guard = text.make_constraint(request(tools=TOOLS))
    assert guard is not None
    written = decode_greedy(text, guard, opening, prefer="create hello.py")
    assert any(written.startswith(name + '"') for name in ("Write", "Bash", "exec_command")), written
    assert guard.guided == 1


def test_a_right_name_is_kept_and_decoding_is_free_afterwards(text):
    guard = text.make_constraint(request(tools=TOOLS))
    written = decode_greedy(text, guard, '{"name": "', prefer='Bash", "arguments": {}}')
    assert written.startswith('Bash"'), written
    assert '"arguments"' in written  # after the name the model writes what it wants


def test_the_next_call_of_a_list_is_guided_too(text):
    guard = text.make_constraint(request(tools=TOOLS))
    prefer = 'Bash", "arguments": {}}, {"name": "create'
    written = decode_greedy(text, guard, '[{"name": "', prefer=prefer, steps=24)
    assert written.startswith('Bash", "arguments": {}}, {"name": "'), written
    second = written.split('{"name": "')[1]
    assert any(second.startswith(n + '"') for n in ("Write", "Bash", "exec_command")), written
    assert guard.guided == 2


@pytest.mark.parametrize(
    "opening, closed",
    [
        ('```json\n{"name": "', "{}}\n```"),
        ('<tool_call>\n{"name": "', "{}}\n</tool_call>"),
        ('{"type": "function", "function": {"name": "', "{}}}"),
        ('{"name": "', "{}}"),
    ],
)
def test_a_call_ends_with_the_markup_it_opened_with(text, opening, closed):
    """Qwen2.5-Coder-0.5B on Claude Code: a valid call object, then `\n</tools>"` before the
    fence closed, so the block was no JSON and stayed text. The guard holds until the markup
    closes; then decoding is free again."""
    guard = text.make_constraint(request(tools=TOOLS))
    written = decode_greedy(text, guard, opening, prefer='Bash", "arguments": {}}\n</tools>"\n}', steps=24)
    squeezed = lambda x: re.sub(r"\s+", "", x)  # noqa: E731 (bounded whitespace is the model's choice)
    assert squeezed(written).startswith(squeezed('Bash", "arguments": ' + closed)), written
    assert guard._matcher is None, "the constraint outlived the call"


AGENT = {
    "type": "function",
    "function": {
        "name": "Agent",
        "parameters": {
            "type": "object",
            "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
            "required": ["description", "prompt"],
            "additionalProperties": False,
        },
    },
}


def test_a_pretty_printed_call_is_allowed_and_its_whitespace_is_bounded(text):
    """Qwen2.5-Coder writes calls pretty-printed; forced into compact JSON it lost its way in
    the arguments. Whitespace is free between tokens, but never more than a bounded run."""
    guard = text.make_constraint(request(tools=[AGENT, *TOOLS]))
    pretty = 'Agent",\n  "arguments": {\n    "description": "d",\n    "prompt": "p"\n  }\n}\n```'
    written = decode_greedy(text, guard, '```json\n{\n  "name": "', prefer=pretty, steps=40)
    assert written.startswith(pretty), written
    guard = text.make_constraint(request(tools=[AGENT, *TOOLS]))
    written = decode_greedy(text, guard, '{"name": "', prefer='Agent",' + " " * 40, steps=30)
    assert " " * 17 not in written, written


def test_the_arguments_must_hold_what_the_tool_requires(text):
    guard = text.make_constraint(request(tools=[AGENT, *TOOLS]))
    # Qwen's real call on Claude Code's tools, which Claude Code refused: no description
    written = decode_greedy(text, guard, '{"name": "', prefer='Agent", "arguments": {"prompt": "hi"}}', steps=40)
    # the model's own next tokens would close the object without it; the schema does not let them
    assert written.startswith('Agent", "arguments": {') and re.search(r'"description":\s*"', written), written


def test_a_partly_written_name_is_completed_among_the_names_it_can_still_be(text):
    guard = text.make_constraint(request(tools=TOOLS))
    written = decode_greedy(text, guard, '{"name": "exec', prefer="_shell")
    assert written.startswith('_command"'), written


@pytest.mark.parametrize(
    "answer",
    [
        'The user record is {"name": "',  # JSON inside prose: not a call
        "Sure! Here is a haiku",
        '```python\nprint({"name": "',  # a code fence of another language
        'Two users: [{"name": "Ann"}, {"name": "',  # a list of records, not of calls
    ],
)
def test_text_that_is_not_a_call_is_left_alone(text, answer):
    guard = text.make_constraint(request(tools=TOOLS))
    written = decode_greedy(text, guard, answer, prefer="Alice")
    assert written.startswith("Alice"), written
    assert guard.guided == 0


def test_off_by_default_and_without_tools(text, smollm2_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxgw.worker.text.chat_text import ChatText

    assert text.make_constraint(request()) is None  # no tools offered
    tokenizer = load_tokenizer(smollm2_dir)
    assert ChatText(tokenizer, tokenizer.vocab_size).make_constraint(request(tools=TOOLS)) is None


def test_models_yaml_field_reaches_the_runner():
    from mlxgw.shared.config import parse_registry

    def entry(**fields):
        return parse_registry({"models": [{"name": "m", **fields}]}).models[0]

    assert entry().chat.tool_name_guard is False
    assert entry(chat={"tool_name_guard": True}).chat.tool_name_guard is True
