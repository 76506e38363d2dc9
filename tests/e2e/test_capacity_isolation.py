"""No request can buy another user's capacity. Against real `mlxgw up` processes
with keys on: bounded, stoppable work in the gateway (bomb PDFs, large bodies, shutdown),
residency only for the operator, tokenizing off the engine thread, templates whose C calls
are bounded, and the views and side doors an ordinary key must not reach."""

from __future__ import annotations

import base64
import os
import signal
import stat
import threading
import time

import psutil
import pytest
import yaml
from helpers import DATA, NO_EOS, audio_bombs, http, openai_client
from helpers.hostile_work import (
    MCP_SERVERS,
    MODELS,
    auth,
    bomb_message,
    keyed_gateway,
    mcp_servers,
    model_status,
    pdf_jobs,
    post_audio,
    timed,
    wait_mcp_ready,
    worker_pids,
)
from helpers.pdf import pdf_bomb, pdf_with_text


@pytest.fixture(scope="module")
def gw(home, tiny_dir):
    gateway = keyed_gateway(home, "hostile-work", MODELS, MCP_SERVERS)
    yield gateway
    gateway.stop()


# -- 1. bounded, stoppable work --------------------------------------------------------------------


def test_six_bomb_pdfs_leave_admin_routes_a_large_chat_and_a_transcription_answering_and_sigterm_stops(
    home, whisper_tiny_dir
):
    """On main: the 400 came at 60 s while pypdf ran on for hours in six executor threads;
    GET /v1/keys, GET /v1/usage and a 300 KB chat timed out at 60 s; SIGTERM did not stop
    the gateway. Now the bombs are refused within their budget and nothing waits on them."""
    whisper = {"name": "whisper-tiny-en", "kind": "audio", "preload": True}
    gw = keyed_gateway(home, "pdf-flood", [MODELS[0], whisper])
    clip = (DATA / "audio" / "fox.wav").read_bytes()
    try:
        # A transcription's normal time on this host (the second one: the first warms the model).
        post_audio(gw, clip, {"model": "whisper-tiny-en"})
        status, payload, normal = post_audio(gw, clip, {"model": "whisper-tiny-en"})
        assert status == 200 and "fox" in payload["text"].lower(), payload
        body = bomb_message(pdf_bomb())
        answers: list[tuple[int, float]] = []

        def send_bomb() -> None:
            (status, _, _), took = timed(lambda: http(gw.url + "/v1/messages", "POST", body, auth("user"), timeout=120))
            answers.append((status, took))

        bombs = [threading.Thread(target=send_bomb) for _ in range(6)]
        for t in bombs:
            t.start()
        time.sleep(0.3)  # the six are being read
        big_chat = {"model": "echo", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 60_000}]}
        probes = {
            "keys": timed(lambda: http(gw.url + "/v1/keys", headers=auth("admin"), timeout=30)),
            "usage": timed(lambda: http(gw.url + "/v1/usage", headers=auth("admin"), timeout=30)),
            "chat": timed(lambda: http(gw.url + "/v1/chat/completions", "POST", big_chat, auth("user"), timeout=30)),
        }
        # The clip is decoded in the audio pool and transcribed by the real worker while the
        # bombs are read: about its normal time, not after the PDFs (on main: 45-60 s). The
        # bombs' children share the two cores with it until they are stopped, hence the slack.
        status, payload, took = post_audio(gw, clip, {"model": "whisper-tiny-en"})
        assert status == 200 and "fox" in payload["text"].lower(), payload
        assert took < 3 * normal + 10, (took, normal)
        for name, ((status, _, payload), took) in probes.items():
            assert status == 200, (name, payload)
            assert took < 5, (name, took)
        for t in bombs:
            t.join(60)
        assert len(answers) == 6 and all(status == 400 for status, _ in answers), answers
        assert max(took for _, took in answers) < 30, answers
        # A second wave, and SIGTERM while it is being read: the gateway stops, no job survives.
        bombs = [threading.Thread(target=send_bomb, daemon=True) for _ in range(6)]
        for t in bombs:
            t.start()
        time.sleep(0.3)
        jobs = pdf_jobs(gw)
        _, took = timed(lambda: gw.stop(timeout=60))
        assert gw.proc.returncode == 0 and took < 20, (gw.proc.returncode, took)
        assert not [pid for pid in jobs if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    finally:
        gw.stop()


def test_a_readable_pdf_still_reaches_the_model(gw):
    status, _, payload = http(
        gw.url + "/v1/messages", "POST", bomb_message(pdf_with_text("quiet harbour")), auth("user")
    )
    assert status == 200, payload
    assert "quiet harbour" in payload["content"][0]["text"]


# -- 2. residency is the operator's -----------------------------------------------------------------


def test_keep_alive_from_an_ordinary_key_neither_unloads_nor_pins(gw):
    before = model_status(gw, "null")
    status, _, payload = http(gw.url + "/api/generate", "POST", {"model": "null", "keep_alive": 0}, auth("user"))
    assert status == 403 and "admin" in payload["error"], payload
    body = {"model": "null", "prompt": "hi", "stream": False, "keep_alive": 0, "options": {"num_predict": 2}}
    status, _, payload = http(gw.url + "/api/generate", "POST", body, auth("user"))
    assert status == 200, payload
    for keep_alive in (-1, "9999999999h"):
        body["keep_alive"] = keep_alive
        assert http(gw.url + "/api/generate", "POST", body, auth("user"))[0] == 200
    time.sleep(1)  # an unload would have started by now
    after = model_status(gw, "null")
    assert after["state"] == "ready" and worker_pids(after) == worker_pids(before)
    assert not after["pinned"]
    # Still leaving on the idle policy (600 s), not kept "forever" (shown as ten years on).
    (ps,) = [m for m in http(gw.url + "/api/ps", headers=auth("admin"))[2]["models"] if m["name"] == "null"]
    assert int(ps["expires_at"][:4]) <= time.gmtime().tm_year + 1, ps


def test_a_key_with_residency_may_unload_through_keep_alive(gw):
    load = {"model": "null-unload", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
    assert http(gw.url + "/api/generate", "POST", load, auth("user"))[0] == 200
    status, _, payload = http(
        gw.url + "/api/generate", "POST", {"model": "null-unload", "keep_alive": 0}, auth("resident")
    )
    assert status == 200 and payload["done_reason"] == "unload", payload
    assert not model_status(gw, "null-unload")["loaded"]


# -- 3. tokenizing off the engine thread ----------------------------------------------------------


def test_a_multi_megabyte_tokenize_does_not_stall_a_stream_on_the_model(gw):
    """On main /tokenize ran on the engine thread: a 9 MB one froze a stream for 32 s and
    was answered 503 "worker did not answer"."""
    stream = openai_client(gw, default_headers=auth("user")).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=5000,
        temperature=0,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
    )
    times: list[float] = []
    first = next(iter(stream))
    times.append(time.monotonic())
    assert first is not None

    def read() -> None:
        try:
            for _ in stream:
                times.append(time.monotonic())
        except Exception:  # closed below
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    prompt = "the quick brown fox jumps over the lazy dog " * 60_000  # 2.6 MB
    started = time.monotonic()
    status, _, payload = http(
        gw.url + "/tokenize", "POST", {"model": "tiny", "prompt": prompt}, auth("user"), timeout=300
    )
    took = time.monotonic() - started
    stream.close()
    reader.join(30)
    assert status == 200 and payload["count"] > 500_000, payload
    during = [b - a for a, b in zip(times, times[1:]) if a >= started and b <= started + took]
    assert during, "the stream ended before the tokenize did; lengthen it"
    # Run on the engine thread the stall is the whole tokenize (1.6 s of 1.8 here, 2.4 of 2.6 in
    # CI); off it the longest gap was 0.16 s of 2.7. A 2-s floor once let the first case pass.
    assert max(during) < max(0.75, took / 4), (max(during), took)


def test_count_tokens_answers_like_a_chat_prompt(gw):
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hello there"}]}
    status, _, payload = http(gw.url + "/v1/messages/count_tokens", "POST", body, auth("user"))
    assert status == 200 and payload["input_tokens"] > 2, payload


# -- 4. templates bounded for real ---------------------------------------------------------------

TEMPLATE_BOMBS = [
    "{{ lipsum(200000)|length }}",
    "{{ 'a'|center(400000000) }}",
    "{{ ('a\\n' * 1000)|indent(1000000) }}",
    "{{ ('a' * 1000)|replace('a', 'b' * 100000) }}",
    "{{ '%999999999d'|format(1) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999s' % 'a' }}",
    "{{ 'a'.ljust(999999999) }}",
    "{{ ('\t' * 1000).expandtabs(1000000) }}",
]


@pytest.mark.parametrize("template", TEMPLATE_BOMBS)
def test_template_c_calls_past_the_budget_are_a_fast_400_and_the_worker_serves_on(gw, template):
    before = worker_pids(model_status(gw, "tiny"))
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    body["chat_template_kwargs"] = {"chat_template": template}
    (status, _, payload), took = timed(
        lambda: http(gw.url + "/v1/chat/completions", "POST", body, auth("user"), timeout=60)
    )
    assert status == 400 and "budget" in payload["error"]["message"], payload
    assert took < 5, took
    after = model_status(gw, "tiny")
    assert worker_pids(after) == before and after["restarts"] == 0


# -- 5. audio measured before decoding ------------------------------------------------------------


@pytest.mark.parametrize(
    "name,make,needle",
    [
        ("a 32 KB WAV whose header says 1 Hz", lambda: audio_bombs.wav(1, 16_000), "sample rate"),
        ("a 0.5 MB FLAC of 115 minutes of silence", lambda: audio_bombs.flac_silence(115 * 60), "from its header"),
        ("a WAV of 64 channels", lambda: audio_bombs.wav(16_000, 160, channels=64), "channels"),
    ],
)
def test_audio_is_refused_from_its_header_before_decoding(gw, name, make, needle):
    """On main the 1-Hz WAV decoded and resampled to the 2-hour limit (+220 MB) and the FLAC
    took the gateway to 1 GB and a 504 after 161 s."""
    rss = psutil.Process(gw.proc.pid).memory_info().rss
    fields = {"model": "ears", "response_format": "json"}
    status, payload, took = post_audio(gw, make(), fields)
    assert status == 400 and needle in payload["error"]["message"], (name, payload)
    assert took < 5, (name, took)
    assert psutil.Process(gw.proc.pid).memory_info().rss - rss < 50 << 20


# -- 6. regular files only in the prefix-cache restore --------------------------------------------


def test_a_fifo_in_the_prefix_cache_folder_does_not_block_the_restoring_worker(gw, home):
    """On main the restoring worker blocked on the FIFO, was silent for 30 s, was killed: twice."""
    folder = home / "prefix-cache" / "tiny-fifo"
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / ("ab" * 16 + ".safetensors"))
    os.mkfifo(folder / "index.json")
    body = {"model": "tiny-fifo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    (status, _, payload), took = timed(
        lambda: http(gw.url + "/v1/chat/completions", "POST", body, auth("user"), timeout=120)
    )
    assert status == 200, payload
    model = model_status(gw, "tiny-fifo")
    assert model["restarts"] == 0 and model["state"] == "ready", model
    assert not (folder / ("ab" * 16 + ".safetensors")).exists()  # skipped and removed
    assert took < 60, took


# -- 7. reloads queue behind a reload -------------------------------------------------------------


def test_reloads_in_quick_succession_fail_no_waiting_request(gw):
    """On main three SIGHUPs under 120 echo streams gave 31 of them 503 "model echo is going
    away": a request waiting for the re-loading model failed when the next reload replaced it."""
    config = yaml.safe_load(gw.config_path.read_text())
    echo = next(m for m in config["models"] if m["name"] == "echo")
    statuses: list[int] = []
    stop = time.monotonic() + 7
    body = {"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]}

    def client() -> None:
        while time.monotonic() < stop:
            statuses.append(http(gw.url + "/v1/chat/completions", "POST", body, auth("user"), timeout=120)[0])

    clients = [threading.Thread(target=client) for _ in range(16)]
    for t in clients:
        t.start()
    for seqs in (5, 6, 7):  # each reload changes echo's entry: it drains and loads again
        time.sleep(1.5)
        echo["max_num_seqs"] = seqs
        gw.config_path.write_text(yaml.safe_dump(config))
        gw.proc.send_signal(signal.SIGHUP)
    for t in clients:
        t.join(180)
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert model_status(gw, "echo")["state"] == "ready"


# -- 8. scoped views -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/cache/stats", "/v1/status/throughput"])
def test_other_users_traffic_views_need_an_admin_key(gw, path):
    status, _, payload = http(gw.url + path, headers=auth("user"))
    assert status == 403 and "admin" in payload["error"]["message"], payload
    assert http(gw.url + path, headers=auth("admin"))[0] == 200


def test_model_lists_show_a_key_only_the_models_it_may_use(gw):
    openai_ids = [m["id"] for m in http(gw.url + "/v1/models", headers=auth("limited"))[2]["data"]]
    assert openai_ids == ["null"]
    tags = [m["name"] for m in http(gw.url + "/api/tags", headers=auth("limited"))[2]["models"]]
    assert tags == ["null"]
    ps = [m["name"] for m in http(gw.url + "/api/ps", headers=auth("limited"))[2]["models"]]
    assert ps == ["null"]
    everything = {m["id"] for m in http(gw.url + "/v1/models", headers=auth("admin"))[2]["data"]}
    assert {"echo", "null", "tiny"} <= everything


def test_health_without_an_admin_key_lists_nothing(gw):
    assert http(gw.url + "/health")[2] == {"status": "ok"}
    assert http(gw.url + "/health", headers=auth("user"))[2] == {"status": "ok"}
    full = http(gw.url + "/health", headers=auth("admin"))[2]
    assert full["models"]["echo"] == "ready" and "mcp" in full


# -- 9. MCP tools: who may call which, and one crash fails no one else's call ---------------------


def test_an_ordinary_key_reaches_only_the_mcp_servers_the_operator_curated(gw):
    wait_mcp_ready(gw)
    assert set(mcp_servers(gw, "user")) == {"tools"}
    assert set(mcp_servers(gw, "admin")) == {"tools", "everything"}
    body = {
        "model": "echo",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "mcp", "server_label": "everything"}],
    }
    status, _, payload = http(gw.url + "/v1/chat/completions", "POST", body, auth("user"))
    assert status == 400 and "unknown MCP server_label 'everything'" in payload["error"]["message"], payload
    body["tools"] = [{"type": "mcp", "server_label": "nope"}]
    message = http(gw.url + "/v1/chat/completions", "POST", body, auth("user"))[2]["error"]["message"]
    assert "tools" not in message.replace("'tools'", "") and "everything" not in message, message  # labels not listed


def test_a_crashing_tool_call_fails_no_other_callers_call(gw):
    """On main a `crash` tool killed the shared stdio server: every call in flight failed."""
    wait_mcp_ready(gw)
    results: dict[str, tuple] = {}

    def execute(name: str, tool: str, arguments: dict) -> None:
        body = {"server_label": "tools", "name": tool, "arguments": arguments}
        results[name] = http(gw.url + "/v1/mcp/execute", "POST", body, auth("admin"), timeout=60)

    calls = [threading.Thread(target=execute, args=(f"add{i}", "slow_add", {"a": i, "b": 1})) for i in range(3)]
    calls.append(threading.Thread(target=execute, args=("crash", "crash", {})))
    for t in calls:
        t.start()
    for t in calls:
        t.join(90)
    for i in range(3):
        status, _, payload = results[f"add{i}"]
        assert status == 200 and payload["output"] == str(i + 1), payload
    assert results["crash"][0] != 200
    # The server comes back for everyone (its state may read "ready" for a moment before the
    # exit is noticed, so wait for a call of a quick tool to go through, not for the state).
    deadline = time.monotonic() + 60
    body = {"server_label": "tools", "name": "noisy", "arguments": {"lines": 0}}
    while http(gw.url + "/v1/mcp/execute", "POST", body, auth("admin"), timeout=60)[0] != 200:
        assert time.monotonic() < deadline, "the MCP server did not come back after the crash"
        time.sleep(0.5)


def test_an_mcp_servers_stderr_is_rate_limited_in_the_log(gw):
    wait_mcp_ready(gw)
    body = {"server_label": "tools", "name": "noisy", "arguments": {"lines": 300}}
    assert http(gw.url + "/v1/mcp/execute", "POST", body, auth("admin"), timeout=60)[0] == 200
    time.sleep(0.5)
    logged = [line for line in gw.log().splitlines() if "stderr: noise line" in line]
    assert 0 < len(logged) <= 20, len(logged)


# -- 10. the small ones ----------------------------------------------------------------------------


def test_usage_since_past_1970_is_a_400_not_minus_infinity(gw):
    status, _, payload = http(gw.url + "/v1/usage?since=" + "9" * 5000 + "d", headers=auth("admin"))
    assert status == 400 and "since" in payload["error"]["message"], payload


def test_usage_db_is_the_owners_only(gw, home):
    assert stat.S_IMODE(os.stat(home / "usage.db").st_mode) == 0o600


def test_ollama_chat_refuses_a_template_like_generate(gw):
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "template": "{{ .Prompt }}"}
    status, _, payload = http(gw.url + "/api/chat", "POST", body, auth("user"))
    assert status == 400 and "template" in payload["error"], payload


def test_responses_input_file_of_plain_text_is_read_as_utf8(gw):
    data = "data:text/plain;base64," + base64.b64encode(b"notes about the harbour").decode()
    part = {"type": "input_file", "filename": "notes.txt", "file_data": data}
    body = {"model": "echo", "input": [{"role": "user", "content": [part]}], "max_output_tokens": 64}
    status, _, payload = http(gw.url + "/v1/responses", "POST", body, auth("user"))
    assert status == 200, payload
    assert "notes about the harbour" in payload["output"][0]["content"][0]["text"]
