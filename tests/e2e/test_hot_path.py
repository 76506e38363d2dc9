"""The lean gateway hot path: what was made cheaper still says the same.

Streams write the events that are already waiting in one socket write, chat chunks are
built from a per-stream template, inter-token gaps are counted into buckets, quarantine
fingerprints are computed only when needed, and the worker sends a loop turn's events as
one frame: every one of these must leave the bytes, counts and orders clients see as they were."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from helpers import http, start_gateway

from mlxgw.gateway.api.openai.chat import ChatChunks
from mlxgw.gateway.link.quarantine import fingerprint
from mlxgw.gateway.link.worker_conn import RequestStream
from mlxgw.gateway.models.token_gaps import ITL_BUCKETS, GapHistogram
from mlxgw.shared import protocol as p

CONFIG = {
    "manager": {"auto_discover": False},
    "models": [{"name": "null", "engine": "null", "preload": True, "max_num_seqs": 64, "max_queue": 256}],
}
TOKENS = 300
STREAMS = 16
MESSAGES = [{"role": "user", "content": "one two three"}]


@pytest.fixture(scope="module")
def null_gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("hotpath"), CONFIG, "hotpath")
    yield gw
    gw.stop()


async def _stream(session: aiohttp.ClientSession, url: str) -> bytes:
    body = {
        "model": "null",
        "messages": MESSAGES,
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.read()


async def _streams(url: str, n: int) -> list[bytes]:
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(_stream(session, url) for _ in range(n)))


def test_concurrent_streams_send_one_event_per_token_with_the_text_of_the_whole_answer(null_gateway):
    status, _, whole = http(
        f"{null_gateway.url}/v1/chat/completions",
        "POST",
        {"model": "null", "messages": MESSAGES, "max_tokens": TOKENS},
    )
    assert status == 200
    for body in asyncio.run(_streams(null_gateway.url, STREAMS)):
        events = [e for e in body.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert texts[0] == ""  # the role chunk
        assert len([t for t in texts[1:] if t]) == TOKENS  # one event per token, none merged
        assert "".join(t for t in texts if t) == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["usage"]["completion_tokens"] == TOKENS


def test_streamed_tokens_are_counted_in_the_inter_token_latency_histogram(null_gateway):
    asyncio.run(_streams(null_gateway.url, 2))
    _, _, text = http(f"{null_gateway.url}/metrics")
    count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('mlxgw_inter_token_latency_seconds_count{model="null"}')
    )
    assert count >= 2 * (TOKENS - 1)
    buckets = [line for line in text.splitlines() if line.startswith("mlxgw_inter_token_latency_seconds_bucket")]
    assert len(buckets) == len(ITL_BUCKETS) + 1 and 'le="+Inf"' in buckets[-1]


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_chat_chunk_from_the_template_is_byte_for_byte_its_json(include_usage):
    chunks = ChatChunks(SimpleNamespace(), SimpleNamespace(model_name='m"odel\\'), include_usage)
    for choice in (0, 3):
        chunks.choice = choice
        for text in ("hi", "", 'quote " back \\ slash', "line\nbreak\ttab", "\x00\x1f", "é ✓ \u2028 😀", "\ud83d"):
            for key in ("content", "reasoning_content"):
                expected = json.dumps(
                    chunks.delta({key: text}), separators=(",", ":"), ensure_ascii=False
                )  # what SSEWriter.data writes for the dict
                assert chunks.text_chunk(key, text) == expected


def test_gaps_fall_in_the_buckets_prometheus_would_count_them_in():
    hist = GapHistogram()
    for bound in ITL_BUCKETS:
        hist.add(bound)  # `le`: a gap equal to a bound counts in that bucket
    hist.add(ITL_BUCKETS[-1] * 10, 3)
    assert hist.counts == [1] * len(ITL_BUCKETS) + [3]
    assert hist.total == pytest.approx(sum(ITL_BUCKETS) + ITL_BUCKETS[-1] * 30)


def test_a_fingerprint_computed_late_from_the_frame_equals_the_one_of_the_request():
    req = p.GenerateRequest(
        rid="r",
        messages=[{"role": "user", "content": "hi"}],
        sampling=p.SamplingParams(temperature=0.3, logit_bias={7: -2.0}),
        stop=["\n"],
        images=[b"\x89PNG"],
    )
    wire = req.to_wire()
    wire["rid"] = "r#1"
    frame = p.encode(req.WIRE_TYPE, request=wire)
    assert RequestStream("r#1", "r", None, frame=frame).fingerprint == fingerprint(wire)


def test_a_request_goes_to_the_wire_as_asdict_would_send_it():
    from dataclasses import asdict

    req = p.GenerateRequest(rid="r", prompt="x", sampling=p.SamplingParams(seed=3), stop=["a"])
    assert req.to_wire() == asdict(req)
    assert p.GenerateRequest.from_wire(req.to_wire()) == req


async def test_events_written_after_a_release_are_held_until_the_next_one():
    from aiohttp import web

    from mlxgw.gateway.web.sse import SSEWriter

    checked = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        sse = SSEWriter(request)
        await sse.data("first")  # not holding yet: goes out at once
        sse.hold()
        await sse.data("second")
        await sse.release()
        await sse.data("third")  # gathered for the next release, which has not come
        await checked.wait()
        await sse.close()  # sends it
        return sse.response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as resp:
            seen = b""
            while b"second" not in seen:
                seen += await asyncio.wait_for(resp.content.readany(), 10)
            await asyncio.sleep(0.2)  # "third" would have arrived by now had it been written
            seen += resp.content.read_nowait()
            assert b"data: first" in seen and b"third" not in seen
            checked.set()
            seen += await resp.content.read()
            assert seen.endswith(b"data: third\n\n")
    finally:
        checked.set()
        await runner.cleanup()
