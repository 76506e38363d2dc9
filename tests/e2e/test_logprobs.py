"""Per-token logprobs through a real `mlxgw up` and the official openai SDK (tiny model):
Chat Completions (logprobs + top_logprobs), Completions (logprobs 0-5) and Responses
(include message.output_text.logprobs), streamed and not. Values are the log-softmax of the
processed logits at temperature 1: checked against mlx-lm run on the same model outside the
server."""

from __future__ import annotations

import json
import math

import openai
import pytest
from helpers import openai_client, run_reference

MSGS = [{"role": "user", "content": "Name three colours."}]
PROMPT_IDS = [1, 504, 3458, 282, 260, 5272, 314]  # a token-id prompt: no template in the way


def chat(client, **kw):
    kw.setdefault("max_tokens", 6)
    return client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, **kw)


def streamed_entries(stream) -> tuple[str, list]:
    text, entries = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                entries += c.logprobs.content
    return text, entries


def test_top_logprobs_are_sorted_and_sum_to_at_most_one(tiny_gateway):
    out = chat(openai_client(tiny_gateway), logprobs=True, top_logprobs=5)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        # greedy: the chosen token is the most likely one
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(values[0], abs=1e-6)
        if not e.token.startswith("bytes:"):
            assert bytes(e.bytes).decode("utf-8") == e.token


def test_text_is_the_tokens_joined(tiny_gateway):
    out = chat(openai_client(tiny_gateway), logprobs=True)
    entries = out.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    assert all(e.top_logprobs == [] for e in entries)


def test_requests_without_logprobs_get_none(tiny_gateway):
    assert chat(openai_client(tiny_gateway)).choices[0].logprobs is None


def test_greedy_logprobs_equal_mlx_lm_recomputed(tiny_gateway, tiny_dir):
    client = openai_client(tiny_gateway)
    out = client.completions.create(model="tiny", prompt=PROMPT_IDS, temperature=0, max_tokens=6, logprobs=2)
    served = out.choices[0].logprobs.token_logprobs
    script = f"""
import json, mlx.core as mx
from mlx_lm import load
model, tok = load({str(tiny_dir)!r})
ids, out = {PROMPT_IDS!r}, []
for _ in range({len(served)}):
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits)
    t = int(mx.argmax(lp).item())
    out.append([t, lp[t].item()])
    ids = ids + [t]
print(json.dumps({{"out": out, "text": tok.decode([t for t, _ in out])}}))
"""
    ref = json.loads(run_reference(script).strip().splitlines()[-1])
    assert served == pytest.approx([v for _, v in ref["out"]], abs=1e-3)
    assert out.choices[0].text == ref["text"]


def test_streamed_logprobs_equal_non_streamed(tiny_gateway):
    client = openai_client(tiny_gateway)
    full = chat(client, logprobs=True, top_logprobs=3).choices[0]
    text, entries = streamed_entries(chat(client, logprobs=True, top_logprobs=3, stream=True))
    assert text == full.message.content
    assert [e.token for e in entries] == [e.token for e in full.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in full.logprobs.content], abs=1e-5)


def test_logprobs_do_not_depend_on_temperature(tiny_gateway):
    """The first token's distribution comes from the same prompt at any temperature: its
    alternatives are reported before temperature is applied."""
    client = openai_client(tiny_gateway)
    cold = chat(client, logprobs=True, top_logprobs=4).choices[0].logprobs.content[0]
    client_hot = client.chat.completions.create(
        model="tiny", messages=MSGS, temperature=1.7, seed=5, max_tokens=1, logprobs=True, top_logprobs=4
    )
    hot = client_hot.choices[0].logprobs.content[0]
    assert [t.token for t in hot.top_logprobs] == [t.token for t in cold.top_logprobs]
    assert [t.logprob for t in hot.top_logprobs] == pytest.approx([t.logprob for t in cold.top_logprobs], abs=1e-5)


def test_logprobs_follow_logit_bias(tiny_gateway, smollm2_tokenizer):
    """Logit processors (bias, penalties) shape the distribution that is reported."""
    (token,) = smollm2_tokenizer.encode(" blue", add_special_tokens=False)
    out = chat(openai_client(tiny_gateway), logprobs=True, max_tokens=1, logit_bias={str(token): 100})
    first = out.choices[0].logprobs.content[0]
    assert first.token == " blue" and first.logprob == pytest.approx(0.0, abs=1e-3)


def test_completions_logprobs_in_the_legacy_shape(tiny_gateway):
    client = openai_client(tiny_gateway)
    out = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(len(top) <= 3 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = client.completions.create(
        model="tiny", prompt="Once upon a time", temperature=0, max_tokens=5, logprobs=3, stream=True
    )
    tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens


# Longer than one scoring chunk (worker/model/runners/prompt_logprobs.py CHUNK_TOKENS = 256): the prompt
# is scored in two steps, and must still equal one full-sequence pass.
ECHO_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 24


def echo_completion(client, **kw):
    kw = {"max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True, **kw}
    return client.completions.create(model="tiny", prompt=ECHO_PROMPT, **kw)


def test_echo_with_logprobs_gives_prompt_logprobs_equal_to_mlx_lm(tiny_gateway, tiny_dir):
    out = echo_completion(openai_client(tiny_gateway))
    choice, lp = out.choices[0], out.choices[0].logprobs
    prompt_count = out.usage.prompt_tokens
    assert prompt_count > 256
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == prompt_count + out.usage.completion_tokens
    assert "".join(lp.tokens[:prompt_count]) == ECHO_PROMPT and choice.text.startswith(ECHO_PROMPT)
    # The first prompt token has nothing before it: null, as OpenAI sends it.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(
        len(top) == 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])
    )
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[prompt_count] == len(ECHO_PROMPT)
    script = f"""
import json, mlx.core as mx
from mlx_lm import load
model, tok = load({str(tiny_dir)!r})
ids = tok.encode({ECHO_PROMPT!r})
logits = model(mx.array([ids]))[0].astype(mx.float32)
lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
print(json.dumps({{"ids": ids, "lp": [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]}}))
"""
    ref = json.loads(run_reference(script).strip().splitlines()[-1])
    assert len(ref["ids"]) == prompt_count
    assert lp.token_logprobs[1:prompt_count] == pytest.approx(ref["lp"], abs=1e-3)


def test_streamed_echo_with_logprobs_sends_the_prompt_first(tiny_gateway):
    client = openai_client(tiny_gateway)
    full = echo_completion(client).choices[0]
    chunks = [c for chunk in echo_completion(client, stream=True) for c in chunk.choices]
    first = chunks[0]
    assert first.text == ECHO_PROMPT and first.logprobs.token_logprobs[0] is None
    assert "".join(first.logprobs.tokens) == ECHO_PROMPT
    text = "".join(c.text for c in chunks)
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    values = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    offsets = [x for c in chunks if c.logprobs for x in c.logprobs.text_offset]
    assert text == full.text and tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-5)


def test_echo_with_logprobs_repeats_the_prompt_for_every_choice(tiny_gateway):
    out = echo_completion(openai_client(tiny_gateway), n=2, temperature=1.0, seed=3)
    count = out.usage.prompt_tokens
    first, second = (c.logprobs for c in out.choices)
    assert first.tokens[:count] == second.tokens[:count] and "".join(first.tokens[:count]) == ECHO_PROMPT
    assert first.token_logprobs[:count] == second.token_logprobs[:count]
    assert all(c.text.startswith(ECHO_PROMPT) for c in out.choices)


def test_responses_include_output_text_logprobs(tiny_gateway):
    client = openai_client(tiny_gateway)
    kw = dict(model="tiny", input="Name three colours.", temperature=0, max_output_tokens=5)
    out = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    part = out.output[0].content[0]
    assert len(part.logprobs) == out.usage.output_tokens
    assert "".join(e.token for e in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    events = list(client.responses.create(include=["message.output_text.logprobs"], stream=True, **kw))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [e.token for e in deltas] == [e.token for e in part.logprobs]
    assert client.responses.create(**kw).output[0].content[0].logprobs == []


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda c: chat(c, logprobs=True, top_logprobs=21), "top_logprobs"),
        (lambda c: chat(c, top_logprobs=2), "top_logprobs"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", logprobs=6), "logprobs"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", logprobs=6, echo=True), "logprobs"),
        (lambda c: c.completions.create(model="tiny", prompt=[1, 2], logprobs=1, echo=True), "echo"),
        (lambda c: c.completions.create(model="echo", prompt="hi", logprobs=1, echo=True), "logprobs"),
        (lambda c: c.responses.create(model="tiny", input="hi", top_logprobs=21), "top_logprobs"),
    ],
    ids=[
        "chat-top-21",
        "chat-top-without-logprobs",
        "completions-6",
        "completions-echo-6",
        "completions-echo-token-prompt",
        "echo-engine-prompt-logprobs",
        "responses-top-21",
    ],
)
def test_bad_logprobs_values_are_400s_naming_the_field(tiny_gateway, call, param):
    with pytest.raises(openai.BadRequestError) as err:
        call(openai_client(tiny_gateway))
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"


def test_prompt_scoring_takes_one_chunk_per_step_while_other_rows_decode(tiny_dir):
    """In-process (the real Scheduler over the real MLXRunner): a long prompt asking for
    prompt logprobs is scored CHUNK_TOKENS positions per engine step, a row that was
    decoding gets its token in every one of those steps, and the scoring pass's KV serves
    the request's prefill (the prompt is computed once)."""
    from mlxgw.shared import protocol as p
    from mlxgw.shared.events import EventKind
    from mlxgw.worker.model.runners.prompt_logprobs import CHUNK_TOKENS
    from mlxgw.worker.process.build_mlx import build_mlx_runner
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner = build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=4, prefill_step_size=128, cache_bytes=1 << 28)
    sched = Scheduler(runner, max_num_seqs=4, max_queue=8)
    greedy = p.SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence
    sched.submit(p.GenerateRequest(rid="decoding", prompt_tokens=[5, 6, 7, 8], max_tokens=60, sampling=greedy))
    while not any(rid == "decoding" and ev.KIND == "delta" for rid, ev in sched.step()):
        pass
    prompt = [100 + i % 4000 for i in range(3 * CHUNK_TOKENS + 10)]
    scored = p.GenerateRequest(rid="scored", prompt_tokens=prompt, max_tokens=2, sampling=greedy, prompt_logprobs=3)
    prefilled_before = sched.prefilled_tokens
    ((_, accepted),) = sched.submit(scored)
    assert accepted.KIND == "accepted"
    steps, entries = 0, None
    while entries is None:
        events = sched.step()
        steps += 1
        assert any(rid == "decoding" and ev.KIND == "delta" for rid, ev in events), steps
        entries = next((ev.entries for rid, ev in events if ev.KIND == EventKind.PROMPT_LOGPROBS), None)
    assert steps == -(-(len(prompt) - 1) // CHUNK_TOKENS)  # one chunk per step: 4 steps
    assert len(entries) == len(prompt) and entries[0]["logprob"] is None and entries[0]["top_logprobs"] is None
    assert all(len(e["top_logprobs"]) == 3 for e in entries[1:])
    while sched.has_work():
        sched.step()
    assert sched.prefilled_tokens - prefilled_before == 1  # only the last prompt token
