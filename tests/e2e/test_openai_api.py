"""OpenAI Chat Completions and Completions through a real `mlxgw up`, driven by the
official openai SDK (tiny random-weight model: outputs are gibberish, but deterministic)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from helpers import async_openai_client, http, openai_client

MSGS = [{"role": "user", "content": "Tell me a story about a dragon."}]


def greedy_chat(client, messages=MSGS, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_chat_non_streaming_and_streaming_agree(tiny_gateway):
    client = openai_client(tiny_gateway)
    full = greedy_chat(client, max_tokens=24)
    assert full.object == "chat.completion" and full.model == "tiny"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    chunks = list(greedy_chat(client, max_tokens=24, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_usage_counts_equal_the_tokenizers_counts(tiny_gateway, smollm2_tokenizer):
    client = openai_client(tiny_gateway)
    out = greedy_chat(client, max_tokens=9)
    prompt = smollm2_tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 9
    assert out.usage.total_tokens == len(prompt) + 9


def test_stream_include_usage_sends_a_final_usage_chunk(tiny_gateway):
    client = openai_client(tiny_gateway)
    chunks = list(greedy_chat(client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_output_before_it(tiny_gateway):
    client = openai_client(tiny_gateway)
    text = greedy_chat(client, max_tokens=30).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model produced too little text to pick a stop string"
    expected = text[: text.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(greedy_chat(client, max_tokens=30, stop=[stop], stream=True))
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = greedy_chat(client, max_tokens=30, stop=stop)
            got, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert got == expected
        assert finish == "stop"


def test_completions_non_streaming_streaming_and_echo(tiny_gateway):
    client = openai_client(tiny_gateway)
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
        )
    )
    assert streamed == out.choices[0].text
    echoed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + out.choices[0].text


def test_completions_accept_token_ids(tiny_gateway, smollm2_tokenizer):
    client = openai_client(tiny_gateway)
    ids = smollm2_tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_alias_and_glob_alias_route_to_the_model(tiny_gateway):
    client = openai_client(tiny_gateway)
    for name in ("gpt-4o-mini", "claude-haiku-4-5"):
        out = client.chat.completions.create(model=name, messages=MSGS, max_tokens=2)
        assert out.model == "tiny"


def test_seeded_sampling_is_reproducible(tiny_gateway):
    client = openai_client(tiny_gateway)
    kw = dict(model="tiny", messages=MSGS, max_tokens=16, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


async def test_eight_concurrent_streams_all_complete_with_their_own_output(tiny_gateway):
    client = openai_client(tiny_gateway)
    prompts = [f"Request {i}: list {i + 2} colours." for i in range(8)]
    sequential = [
        greedy_chat(client, [{"role": "user", "content": q}], max_tokens=20).choices[0].message.content for q in prompts
    ]
    aclient = async_openai_client(tiny_gateway)

    async def one(q: str) -> str:
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": q}], max_tokens=20, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    concurrent = await asyncio.gather(*(one(q) for q in prompts))
    assert concurrent == sequential
    assert len(set(concurrent)) > 1


def test_every_response_carries_a_request_id(tiny_gateway):
    status, headers, _ = http(f"{tiny_gateway.url}/v1/models")
    assert status == 200 and headers["x-request-id"].startswith("req_")
    status, headers, _ = http(
        f"{tiny_gateway.url}/v1/chat/completions",
        "POST",
        {"model": "tiny", "messages": MSGS, "max_tokens": 1},
        headers={"x-request-id": "my-trace-42"},
    )
    assert status == 200 and headers["x-request-id"] == "my-trace-42"


def test_models_and_health_report_every_model(tiny_gateway):
    client = openai_client(tiny_gateway)
    models = {m.id: m for m in client.models.list().data}
    assert {"tiny", "tiny-crash", "null"} <= set(models)
    status, _, health = http(f"{tiny_gateway.url}/health")
    assert status == 200 and health["models"]["tiny"] == "ready"


def test_max_tokens_beyond_the_context_is_clamped(tiny_gateway):
    client = openai_client(tiny_gateway)
    out = client.completions.create(model="null", prompt="a b c", max_tokens=10_000_000)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 32768 - 3


def test_openai_sdk_raises_not_found_for_unknown_model(tiny_gateway):
    client = openai_client(tiny_gateway)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MSGS)
    assert info.value.body["code"] == "model_not_found"


# -- status codes stay true while a model loads -----------------------------------------------


def test_a_cold_model_refuses_a_too_long_prompt_with_a_400_not_200_and_an_error_event(tiny_gateway):
    assert tiny_gateway.model_status("tiny-cold")["state"] != "ready"
    with pytest.raises(openai.BadRequestError, match="context"):
        stream = openai_client(tiny_gateway).chat.completions.create(
            model="tiny-cold", messages=[{"role": "user", "content": "word " * 200}], max_tokens=5, stream=True
        )
        list(stream)


async def test_load_keepalives_start_only_once_a_load_ran_for_20_s():
    """Keep-alives commit status 200; before 20 s of loading none is sent, so a refusal found
    after a short load is still a plain 4xx."""
    from mlxgw.gateway.models.generation import LOAD_KEEPALIVE_AFTER_S, Generation
    from mlxgw.shared.errors import ErrorCode, ServiceError
    from mlxgw.shared.protocol import GenerateRequest

    class LoadingManager:  # acquire ticks once, as the manager does while a load runs
        broker = None

        async def acquire(self, slot, on_wait, tick_s, route=None):
            await on_wait()
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, "the test stops here")

    ticks = []

    async def keepalive():
        ticks.append(1)

    gen = Generation(LoadingManager(), None, GenerateRequest(rid="r"))
    gen.on_wait = keepalive
    with pytest.raises(ServiceError):
        await gen.__aenter__()
    assert ticks == []
    gen.started -= LOAD_KEEPALIVE_AFTER_S
    with pytest.raises(ServiceError):
        await gen.__aenter__()
    assert ticks == [1]


# -- defaults and discovery for simple clients ------------------------------------------------


def test_requests_without_max_tokens_get_the_model_default_else_4096(tiny_gateway):
    client = openai_client(tiny_gateway)
    messages = [{"role": "user", "content": "Go on forever."}]
    bounded = client.chat.completions.create(model="null", messages=messages)
    assert bounded.usage.completion_tokens == 4096 and bounded.choices[0].finish_reason == "length"
    per_model = client.chat.completions.create(model="null-default", messages=messages)
    assert per_model.usage.completion_tokens == 7


def test_models_retrieve_works_in_both_sdks(tiny_gateway):
    import anthropic

    client = openai_client(tiny_gateway)
    assert client.models.retrieve("tiny").id == "tiny"
    assert client.models.retrieve("gpt-4o-mini").id == "tiny"  # an alias names its model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such")
    claude = anthropic.Anthropic(base_url=tiny_gateway.url, api_key="unused", max_retries=0)
    model = claude.models.retrieve("claude-sonnet-4-5")
    assert model.type == "model" and model.id == "tiny"
    assert "tiny" in [m.id for m in claude.models.list()]
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such")


def test_head_root_answers_200(tiny_gateway):
    status, _, _ = http(tiny_gateway.url + "/", "HEAD")
    assert status == 200


# -- every field range-checked at the boundary ------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2),
        ("seed", -(2**63) - 1),
        ("seed", 2**63),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("max_tokens", 0),
        ("max_tokens", 2**31),
        ("stop", [""]),
        ("stop", ["x"] * 17),
        ("logit_bias", {"-5": 1}),
        ("logit_bias", {"99999999999": 1}),
        ("logit_bias", {"5": 101}),
        ("priority", 1000),
        ("stream", "yes"),
    ],
)
def test_out_of_range_fields_are_400s_naming_the_field(tiny_gateway, field, value):
    body = {"model": "tiny", "messages": MSGS, field: value}
    for path in ("/v1/chat/completions", "/v1/completions"):
        if path == "/v1/completions":
            body = {"model": "tiny", "prompt": "x", field: value}
        status, _, payload = http(tiny_gateway.url + path, "POST", body)
        assert status == 400, payload
        assert payload["error"]["param"] == field and field in payload["error"]["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400s(tiny_gateway, literal):
    raw = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "x"}}], "temperature": {literal}}}'
    status, _, payload = http(tiny_gateway.url + "/v1/chat/completions", "POST", raw=raw.encode())
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"


def test_prompt_cache_hints_are_accepted_and_checked(tiny_gateway):
    """prompt_cache_key and prompt_cache_retention as OpenAI spells them: accepted on Chat
    Completions and Responses; a retention OpenAI does not have is a 400 naming the field."""
    client = openai_client(tiny_gateway)
    hints = {"prompt_cache_key": "team-a", "prompt_cache_retention": "24h"}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=hints
    )
    assert chat.choices[0].message.content is not None
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body=hints).output
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_retention": "forever"}
    status, _, out = http(f"{tiny_gateway.url}/v1/chat/completions", method="POST", body=body)
    assert status == 400 and "prompt_cache_retention" in out["error"]["message"], out
