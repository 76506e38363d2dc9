"""A gateway that does not run for seconds (SIGSTOP here; a long GIL hold or a loaded host
in life) loses nothing: its workers keep their link and every frame for it, and once it
runs again every stream completes with exactly its text, and nothing stays in flight.

Before the fix the workers gave the gateway up after ~6 s, replaced their sockets and
dropped the frames queued in them: streams ended [DONE] with the middle of their text
missing, or never ended, and in_flight stayed above 0 for good."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request

from helpers import start_gateway, wait_for

from mlxgw.worker.process.link import WorkerLink

# Twice the liveness window (heartbeat_s x liveness = 0.5 s x 5 below), as 10 s was at the
# default 1-s heartbeat: the old worker gave its gateway up within it.
STALL_S = 5.0
STREAMS = 4
# A known text, long enough that the streams are still running when the gateway stops (the
# echo engine says it back byte by byte), each stream's its own.
TEXTS = [" ".join(f"s{i}w{n:05d}" for n in range(1_600)) for i in range(STREAMS)]

# The stream whose client leaves during the stall: about half a minute of echo on its own, so
# only a delivered cancel lets in_flight return to 0 within the wait below.
LEAVER_CHARS = 1_500_000

CONFIG = {
    "manager": {"auto_discover": False, "heartbeat_s": 0.5},
    "models": [{"name": "echo", "engine": "echo", "preload": True, "context_length": 4_000_000}],
}


class Stream(threading.Thread):
    """One streaming chat completion, read as raw SSE: the text, [DONE], or an error."""

    def __init__(self, url: str, text: str):
        super().__init__(daemon=True)
        self.url, self.text = url, text
        self.received: list[str] = []
        self.done = False
        self.error: object = None
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "model": "echo",
            "stream": True,
            "max_tokens": len(self.text) + 8,
            "messages": [{"role": "user", "content": self.text}],
        }
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        self.done = True
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.error = chunk["error"]
                        return
                    for choice in chunk.get("choices", []):
                        content = choice.get("delta", {}).get("content")
                        if content:
                            self.received.append(content)
                            self.started.set()
        except Exception as e:  # an HTTP error is an explicit error too; recorded, judged below
            self.error = repr(e)
        finally:
            self.started.set()

    @property
    def content(self) -> str:
        return "".join(self.received)


def _open_and_leave(port: int, text: str) -> http.client.HTTPConnection:
    """A stream of a text that would take minutes, read until its first content: the test
    then hangs up while the gateway is stopped, and only a delivered cancel ends it soon."""
    messages = [{"role": "user", "content": text}]
    body = {"model": "echo", "stream": True, "max_tokens": len(text) + 8, "messages": messages}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    while b'"content"' not in response.fp.readline():
        pass
    return conn


def _in_flight(gw) -> int:
    return next(m for m in gw.status()["models"] if m["name"] == "echo")["in_flight"]


def test_a_stopped_gateway_loses_no_event_and_leaks_no_request(home):
    gw = start_gateway(home, CONFIG, "stall-gateway")
    try:
        worker = gw.worker_pid("echo")
        streams = [Stream(gw.url, text) for text in TEXTS]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60), "no stream started"
        leaver = _open_and_leave(gw.port, "x" * LEAVER_CHARS)
        gw.proc.send_signal(signal.SIGSTOP)
        cut = [len(s.content) for s in streams]
        leaver.sock.shutdown(socket.SHUT_RDWR)  # the client leaves while the gateway is stopped
        leaver.close()
        time.sleep(STALL_S)
        gw.proc.send_signal(signal.SIGCONT)
        for s in streams:
            s.join(120)
        assert any(n < len(t) for n, t in zip(cut, TEXTS)), "every stream ended before the stall: nothing was tested"
        for s, text in zip(streams, TEXTS):
            assert s.error is None, s.error
            assert s.done and s.content == text, (len(s.content), len(text))
        wait_for(lambda: _in_flight(gw) == 0, timeout=8)  # the leaver's cancel reached the worker
        assert gw.worker_pid("echo") == worker  # the stall blamed no worker, and none dropped its state
        assert "reconnecting" not in gw.log()
    finally:
        gw.proc.send_signal(signal.SIGCONT)
        gw.stop()


def test_a_worker_counts_no_silence_while_its_gateway_is_stopped():
    """A local worker leaves after --orphan-after seconds of silence only while its gateway
    could have answered: a gateway stopped for longer (SIGSTOP, a debugger) is waited for."""
    stand_in = subprocess.Popen(["sleep", "60"])
    link = WorkerLink("ipc:///nonexistent", {"worker_id": "w", "model": "m"}, orphan_after=1.0)
    link._parent = stand_in.pid  # the process this worker takes for its gateway
    try:
        assert not link._gateway_stopped()
        stand_in.send_signal(signal.SIGSTOP)
        assert wait_for(link._gateway_stopped, timeout=5)
        stand_in.send_signal(signal.SIGCONT)
        assert wait_for(lambda: not link._gateway_stopped(), timeout=5)
    finally:
        stand_in.kill()
        stand_in.wait()
        link._engine_side.close(0)
        link._io_side.close(0)
