"""End to end with the real default model (SmolLM2-135M-Instruct, imported from PyPI)."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import async_openai_client, http, openai_client, run_reference

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_default_model_answers_paris_through_the_gateway(real_gateway):
    client = openai_client(real_gateway)
    out = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_default_config_serves_chat_and_embeddings_together(real_gateway):
    models = {m["id"]: m for m in http(f"{real_gateway.url}/v1/models")[2]["data"]}
    assert models["smollm2-135m"]["kind"] == "chat" and models["minilm-l6"]["kind"] == "embedding"
    assert models["smollm2-135m"]["loaded"] and models["minilm-l6"]["loaded"]  # both preloaded
    client = openai_client(real_gateway)

    async def both():
        aclient = async_openai_client(real_gateway)
        try:
            return await asyncio.gather(
                aclient.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, temperature=0, max_tokens=8),
                aclient.embeddings.create(model="text-embedding-3-small", input=["Paris", "France's capital"]),
            )
        finally:
            await aclient.close()

    chat, emb = asyncio.run(both())
    assert "Paris" in chat.choices[0].message.content
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384
    assert client.embeddings.create(model="minilm-l6", input="x").usage.prompt_tokens == 3


def test_curl_style_request_streams_paris(real_gateway):
    status, headers, text = http(
        f"{real_gateway.url}/v1/chat/completions",
        "POST",
        {"model": "smollm2-135m", "messages": QUESTION, "temperature": 0, "stream": True},
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert "Paris" in content


def test_greedy_output_equals_mlx_lm_generate(real_gateway, smollm2_dir):
    messages = [{"role": "user", "content": "Name three fruits and describe one of them."}]
    client = openai_client(real_gateway)
    out = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0, max_tokens=40)
    reference = run_reference(f"""
from mlx_lm import load, generate
model, tok = load({str(smollm2_dir)!r})
prompt = tok.apply_chat_template({messages!r}, add_generation_prompt=True)
print(generate(model, tok, prompt, max_tokens=40), end="")
""")
    assert out.choices[0].message.content == reference


async def test_eight_concurrent_real_streams_are_correct(real_gateway):
    questions = [
        "What is the capital of France?",
        "What is 2 plus 2?",
        "Name a primary colour.",
        "What animal says moo?",
        "What is the opposite of hot?",
        "Which planet is red?",
        "What do bees make?",
        "What is frozen water called?",
    ]
    client = openai_client(real_gateway)

    def msgs(q):
        return [{"role": "user", "content": q + " Answer briefly."}]

    sequential = [
        client.chat.completions.create(model="smollm2-135m", messages=msgs(q), temperature=0, max_tokens=16)
        .choices[0]
        .message.content
        for q in questions
    ]
    aclient = async_openai_client(real_gateway)

    async def one(q):
        stream = await aclient.chat.completions.create(
            model="smollm2-135m", messages=msgs(q), temperature=0, max_tokens=16, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    concurrent = await asyncio.gather(*(one(q) for q in questions))
    assert concurrent == sequential
    assert "Paris" in concurrent[0]
    assert "4" in concurrent[1] or "four" in concurrent[1].lower()
    assert len(set(concurrent)) == len(questions)


def test_multi_turn_conversation_reuses_the_prefix_cache(real_gateway):
    client = openai_client(real_gateway)
    history = [{"role": "user", "content": "Tell me about the Eiffel Tower in two sentences."}]
    first = client.chat.completions.create(model="smollm2-135m", messages=history, temperature=0, max_tokens=40)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "How tall is it?"},
    ]
    second = client.chat.completions.create(model="smollm2-135m", messages=history, temperature=0, max_tokens=20)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(real_gateway):
    """A long prompt arriving must not freeze the streams already decoding."""
    import threading
    import time

    client = openai_client(real_gateway)
    stamps: list[float] = []
    started = threading.Event()
    enough_after: list[float] = []  # once the long prompt is in: the stream leaves after this

    def running_stream():
        with client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Count from one to one hundred."}],
            max_tokens=120,
            temperature=0,
            stream=True,
        ) as stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.monotonic())
                    if len(stamps) == 5:
                        started.set()
                    if enough_after and stamps[-1] > enough_after[0]:
                        return  # the gaps that matter are in: the rest of the count proves nothing

    t = threading.Thread(target=running_stream)
    t.start()
    assert started.wait(60)
    long_text = " ".join(f"item{i} is fine." for i in range(300))  # ~1,500 tokens
    t0 = time.monotonic()
    out = client.chat.completions.create(
        model="smollm2-135m", max_tokens=1, messages=[{"role": "user", "content": long_text}]
    )
    t1 = time.monotonic()
    enough_after.append(t1 + 0.5)
    t.join(120)
    assert out.usage.prompt_tokens > 1200
    print(
        f"prefill {t1 - t0:.2f} s for {out.usage.prompt_tokens} tokens; worst gap meanwhile "
        f"{max(b - a for a, b in zip(stamps, stamps[1:]) if t0 <= b <= t1 + 0.5):.2f} s"
    )
    window = [b - a for a, b in zip(stamps, stamps[1:]) if t0 <= b <= t1 + 0.5]
    assert window, "the running stream produced nothing while the long prompt was prefilled"
    # With 512-token chunks the worst gap is about one chunk, far below the whole prefill.
    assert max(window) < 0.6 * (t1 - t0), (max(window), t1 - t0)
