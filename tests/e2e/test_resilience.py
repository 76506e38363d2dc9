"""Failures the gateway must survive: dead workers, gone clients, full queues, timeouts,
garbage on the ZeroMQ link, and shutdown without orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import openai
import psutil
import pytest
import zmq
from helpers import (
    LONG,
    NO_EOS,
    TINY_CONFIG,
    cancel_request,
    http,
    openai_client,
    running,
    start_gateway,
    start_long_stream,
    wait_for,
)

MSGS = [{"role": "user", "content": "Write a very long story."}]


def test_kill_9_worker_mid_stream_ends_the_stream_with_an_error(tiny_gateway):
    client = openai_client(tiny_gateway)
    stream = client.chat.completions.create(
        model="tiny-crash",
        messages=MSGS,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
    )
    received = 0
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            received += 1
            if received == 5:
                os.kill(tiny_gateway.worker_pid("tiny-crash"), signal.SIGKILL)
    assert received >= 5
    assert "stopped" in str(info.value) or "worker" in str(info.value)
    # The model is reported down (or already restarting), other routes keep serving.
    state = tiny_gateway.model_status("tiny-crash")["state"]
    assert state in ("restarting", "loading", "ready")
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    assert out.usage.completion_tokens == 3
    # The supervisor restarts the worker; the next request succeeds.
    out = client.chat.completions.create(model="tiny-crash", messages=MSGS, max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert tiny_gateway.model_status("tiny-crash")["restarts"] >= 1


async def test_client_disconnect_cancels_the_generation(tiny_gateway):
    tiny_gateway.worker_pid("tiny")
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{tiny_gateway.url}/v1/chat/completions",
            json={"model": "tiny", "messages": MSGS, "max_tokens": LONG, "stream": True, "logit_bias": NO_EOS},
        )
        async for _ in resp.content:
            break
        await asyncio.to_thread(wait_for, lambda: running(tiny_gateway, "tiny") >= 1)
        resp.close()
    await asyncio.to_thread(wait_for, lambda: running(tiny_gateway, "tiny") == 0, 10)


def test_cancel_endpoint_ends_a_running_request(tiny_gateway):
    chunks = start_long_stream(tiny_gateway, "tiny", "cancel-me-1")
    status, _, body = http(f"{tiny_gateway.url}/v1/requests/cancel-me-1/cancel", "POST", {})
    assert status == 200 and body["cancelled"] is True
    with pytest.raises(openai.APIError, match="cancelled"):
        for _ in chunks:
            pass
    wait_for(lambda: running(tiny_gateway, "tiny") == 0, 10)
    assert cancel_request(tiny_gateway, "cancel-me-1") == 404


async def test_full_queue_answers_429_with_retry_after(tiny_gateway):
    # max_num_seqs 1, max_queue 1: one running, one waiting, the third is refused.
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny-small-queue", "messages": MSGS, "max_tokens": LONG, "stream": True, "logit_bias": NO_EOS}
        first = await session.post(f"{tiny_gateway.url}/v1/chat/completions", json=body)
        assert first.status == 200
        second = await session.post(f"{tiny_gateway.url}/v1/chat/completions", json=body)
        assert second.status == 200
        third = await session.post(f"{tiny_gateway.url}/v1/chat/completions", json=body)
        assert third.status == 429
        assert int(third.headers["Retry-After"]) >= 1
        payload = await third.json()
        assert payload["error"]["code"] == "overloaded"
        first.close()
        second.close()


def test_malformed_messages_on_the_link_are_dropped(tiny_gateway):
    endpoint = next(line.split("endpoint ")[1] for line in tiny_gateway.log().splitlines() if "endpoint " in line)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    for frame in (b"\x00garbage", b"\x93\x01\x02", b"\x81\xa1v\x63", b"", b"\x82\xa1v\x01\xa1t\xa5alien"):
        sock.send(frame)
    sock.send_multipart([b"a", b"b", b"c"])
    wait_for(lambda: tiny_gateway.status()["dropped_messages"] >= 5, 10)  # dropped as they are read
    sock.close(0)
    ctx.term()
    out = openai_client(tiny_gateway).chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_timeout_and_clean_shutdown_leave_no_orphans(home, tiny_dir):
    gw = start_gateway(home, TINY_CONFIG, "timeout-gateway", extra_args=("--timeout", "2"))
    try:
        client = openai_client(gw)
        started = time.monotonic()
        finish = None  # the time limit ends the answer with what it generated
        for chunk in client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=LONG, stream=True, extra_body={"logit_bias": NO_EOS}
        ):
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        assert finish == "length"
        assert time.monotonic() - started < 30
        workers = gw.descendants()
        assert workers, "the gateway should have worker processes"
    finally:
        code = gw.stop(signal.SIGTERM)
    assert code == 0
    time.sleep(0.5)
    alive = [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_a_flood_of_events_is_never_dropped(home, tiny_dir, monkeypatch):
    """The null engine emits events faster than the gateway reads them. With a tiny send
    queue on the worker's link, the worker must hold frames back (backpressure), not drop
    them: every request still ends with its finish."""
    import concurrent.futures

    monkeypatch.setenv("MLXGW_LINK_SNDHWM", "4")
    gw = start_gateway(
        home,
        {
            "manager": {"auto_discover": False},
            "models": [{"name": "null", "engine": "null", "preload": True, "max_num_seqs": 8}],
        },
        "flood-gateway",
    )
    try:
        client = openai_client(gw, timeout=120)

        def one(i: int) -> int:
            return client.completions.create(model="null", prompt=f"flood {i}", max_tokens=1500).usage.completion_tokens

        # 9,000 events against a 4-frame send queue: the queue is full from the first tokens on
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(one, range(6))) == [1500] * 6
    finally:
        gw.stop()


def test_two_concurrent_requests_with_the_same_request_id_both_complete(tiny_gateway):
    """A client's x-request-id is echoed and logged, never the routing key."""
    import concurrent.futures

    client = openai_client(tiny_gateway)

    def ask(content: str) -> tuple[str, str, int]:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=12,
            temperature=0,
            extra_headers={"x-request-id": "shared-id-1"},
            extra_body={"logit_bias": NO_EOS},
        )
        out = raw.parse()
        return out.choices[0].message.content, raw.headers["x-request-id"], out.usage.completion_tokens

    alone = [ask("Tell me about cats."), ask("Tell me about ships.")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, ["Tell me about cats.", "Tell me about ships."]))
    assert together == alone
    assert all(rid == "shared-id-1" and n == 12 for _, rid, n in together)
    wait_for(lambda: tiny_gateway.model_status("tiny")["in_flight"] == 0, 10)


def test_a_request_the_wire_cannot_carry_is_a_400_and_leaves_nothing_in_flight(tiny_gateway):
    tiny_gateway.worker_pid("tiny")
    bodies = [
        b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "tiny", "max_tokens": 2, "seed": 18446744073709551616, "messages": [{"role": "user", '
        b'"content": "hi"}]}',
    ]
    for raw in bodies:
        status, _, body = http(f"{tiny_gateway.url}/v1/chat/completions", "POST", raw=raw)
        assert status == 400, body
    assert tiny_gateway.model_status("tiny")["in_flight"] == 0
    assert tiny_gateway.status()["in_flight"] == 0


@pytest.fixture(scope="module")
def crash_gateway(home, tiny_dir):
    config = {
        "manager": {"auto_discover": False, "heartbeat_s": 0.5, "liveness": 4, "restart_backoff_s": 0.1},
        "models": [{"name": "victim", "source": "tiny", "preload": True}, {"name": "bystander", "source": "tiny"}],
    }
    gw = start_gateway(home, config, "crash-gateway")
    yield gw
    gw.stop()


def test_a_request_in_flight_at_two_crashes_is_refused_with_a_400_naming_it(crash_gateway):
    gw = crash_gateway
    poison = "This exact request is in flight whenever the worker dies."
    for crash in range(2):
        pid = gw.worker_pid("victim")
        stream = start_long_stream(gw, "victim", f"poison-{crash}", content=poison)
        innocent = start_long_stream(gw, "victim", f"innocent-{crash}", content=f"Innocent request {crash}.")
        os.kill(pid, signal.SIGKILL)
        for s in (stream, innocent):
            with pytest.raises(openai.APIError):
                for _ in s:
                    pass
        wait_for(lambda p=pid: gw.worker_pid("victim") != p, 60)
    with pytest.raises(openai.BadRequestError) as info:
        start_long_stream(gw, "victim", "poison-2", content=poison)
    status = gw.status()
    (entry,) = status["quarantined_requests"]
    assert entry["fingerprint"] in str(info.value) and entry["model"] == "victim"
    refusal = next(line for line in gw.log().splitlines() if "request_id=poison-2 " in line)
    assert "status=400" in refusal and "outcome=error:invalid_request" in refusal  # logged as what it was
    out = openai_client(gw).chat.completions.create(
        model="victim", messages=[{"role": "user", "content": "Innocent request 0."}], max_tokens=2
    )
    assert out.usage.completion_tokens == 2  # in flight at one crash only: still served
    assert gw.model_status("victim")["in_flight"] == 0
    assert gw.model_status("victim")["state"] == "ready"


def test_a_stalled_gateway_restarts_no_worker(crash_gateway):
    """SIGSTOP the gateway for longer than the liveness window (2 s here): when it runs again
    it blames nobody, and every worker is the one it had."""
    gw = crash_gateway
    openai_client(gw).chat.completions.create(model="bystander", messages=MSGS, max_tokens=2)
    before = {m["name"]: (m["restarts"], [w["pid"] for w in m["workers"]]) for m in gw.status()["models"]}
    log_before = len(gw.log())
    os.kill(gw.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(4)  # twice the window
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)
    time.sleep(3)  # a few liveness rounds after the stall
    after = {m["name"]: (m["restarts"], [w["pid"] for w in m["workers"]]) for m in gw.status()["models"]}
    assert after == before
    assert "lost worker" not in gw.log()[log_before:]
    assert gw.status()["host_stalls"] >= 1
    out = openai_client(gw).chat.completions.create(model="bystander", messages=MSGS, max_tokens=2)
    assert out.usage.completion_tokens == 2
