"""n > 1 choices through a real `mlxgw up` and the official openai SDK (tiny model): the
choices share one prompt prefill, decode in one batch, stream with their index, are counted
together in usage, and choice i with seed s equals the single answer with seed s + i."""

from __future__ import annotations

import secrets

import openai
import pytest
from helpers import LONG, NO_EOS, http, openai_client, running, wait_for

SAMPLING = dict(temperature=1.0, max_tokens=8)


def ask(client, content: str, **kw):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model="tiny", messages=messages, **{**SAMPLING, **kw})


def cache_stats(gw) -> dict:
    status, _, body = http(f"{gw.url}/v1/cache/stats?model=tiny")
    assert status == 200
    return body["models"]["tiny"][0]


def test_n3_with_a_seed_gives_three_choices_each_equal_to_its_seed(tiny_gateway):
    client = openai_client(tiny_gateway)
    out = ask(client, "Write a word.", n=3, seed=42)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) == 3
    singles = [ask(client, "Write a word.", seed=42 + i).choices[0].message.content for i in range(3)]
    assert texts == singles


def test_choices_share_one_prefill_and_usage_counts_the_prompt_once(tiny_gateway):
    client = openai_client(tiny_gateway)
    content = f"A prompt no earlier test sent: {secrets.token_hex(16)} " * 4
    before = cache_stats(tiny_gateway)
    out = ask(client, content, n=3, seed=7, logprobs=True)
    after = cache_stats(tiny_gateway)
    prompt = out.usage.prompt_tokens
    computed = (after["prompt_tokens"] - before["prompt_tokens"]) - (after["reused_tokens"] - before["reused_tokens"])
    # One prefill of the prompt, then one token for each of the two other choices.
    assert computed <= prompt + 2 < 3 * prompt
    single = ask(client, content, seed=7)
    assert single.usage.prompt_tokens == prompt
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
    assert out.usage.total_tokens == prompt + out.usage.completion_tokens


def test_streamed_choices_carry_their_index(tiny_gateway):
    client = openai_client(tiny_gateway)
    full = ask(client, "Count.", n=2, seed=3)
    chunks = list(ask(client, "Count.", n=2, seed=3, stream=True, stream_options={"include_usage": True}))
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finishes == {c.index: c.finish_reason for c in full.choices}
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_n_with_logprobs(tiny_gateway):
    client = openai_client(tiny_gateway)
    out = client.completions.create(model="tiny", prompt="Once", n=2, seed=9, logprobs=1, **SAMPLING)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        # mlx-lm's detokenizer drops the space a first token starts with; the token keeps it
        assert "".join(c.logprobs.tokens) in (c.text, " " + c.text)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)


def test_best_of_equal_to_n_is_taken(tiny_gateway):
    out = openai_client(tiny_gateway).completions.create(model="tiny", prompt="Once", n=2, best_of=2, **SAMPLING)
    assert len(out.choices) == 2


def mean_logprob(choice) -> float:
    values = choice.logprobs.token_logprobs
    return sum(values) / len(values) if values else float("-inf")


def test_best_of_returns_the_n_candidates_with_the_highest_logprob_per_token(tiny_gateway):
    """best_of 4 generates the same four candidates as n=4 with the same seed (candidate i
    samples with seed + i), and returns the two of them with the highest mean logprob."""
    client = openai_client(tiny_gateway)
    kw = dict(model="tiny", prompt="Once upon a time", seed=21, logprobs=1, **SAMPLING)
    candidates = client.completions.create(n=4, **kw)
    assert len({c.text for c in candidates.choices}) > 2  # the ranking has something to rank
    ranked = sorted(candidates.choices, key=lambda c: (-mean_logprob(c), c.index))
    assert [c.index for c in ranked[:2]] != [0, 1]  # so returning the first two would fail
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.logprobs.token_logprobs for c in best.choices] == [c.logprobs.token_logprobs for c in ranked[:2]]
    # usage counts every candidate generated, as OpenAI does
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
    assert best.usage.prompt_tokens == candidates.usage.prompt_tokens


def test_best_of_without_logprobs_returns_none(tiny_gateway):
    """The candidates are ranked on logprobs the client did not ask for: none are returned."""
    out = openai_client(tiny_gateway).completions.create(model="tiny", prompt="Once", best_of=3, seed=5, **SAMPLING)
    assert len(out.choices) == 1 and out.choices[0].index == 0 and out.choices[0].logprobs is None


def test_a_client_that_leaves_ends_every_choice(tiny_gateway):
    client = openai_client(tiny_gateway)
    stream = ask(client, "Write a long story.", n=3, seed=1, max_tokens=LONG, logit_bias=NO_EOS, stream=True)
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices if c.delta.content}
        if len(seen) == 3:
            break
    stream.close()
    wait_for(lambda: running(tiny_gateway, "tiny") == 0)
    assert ask(client, "Still there?", n=2, max_tokens=2, logit_bias=NO_EOS).usage.completion_tokens == 4


def test_choices_queue_behind_a_one_sequence_batch(tiny_gateway):
    """max_num_seqs 1: the choices run one after another, and still all end."""
    messages = [{"role": "user", "content": "One word."}]
    out = openai_client(tiny_gateway).chat.completions.create(
        model="tiny-serial", messages=messages, n=3, seed=4, **SAMPLING
    )
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.finish_reason for c in out.choices)


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda c: ask(c, "hi", n=0), "n"),
        (lambda c: ask(c, "hi", n=1000), "n"),
        (lambda c: ask(c, "hi", n=17), "n"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", n=1000), "n"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", best_of=3, stream=True), "best_of"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", n=3, best_of=2), "best_of"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", best_of=17), "best_of"),
        (lambda c: c.completions.create(model="tiny", prompt="hi", best_of=0), "best_of"),
    ],
    ids=[
        "chat-0",
        "chat-1000",
        "chat-17",
        "completions-1000",
        "best-of-streamed",
        "best-of-below-n",
        "best-of-17",
        "best-of-0",
    ],
)
def test_bad_n_is_a_400_naming_the_field(tiny_gateway, call, param):
    with pytest.raises(openai.BadRequestError) as err:
        call(openai_client(tiny_gateway))
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
