"""A slow host is not a hung worker.

On a busy 2-core host a fresh worker's first 512-token prefill step of a 0.5B model ran past
the 120-s hang watchdog; the worker was killed twice and the user's request was then refused
as poison. Here the host is made slow on purpose (MLXGW_TEST_SLOW_PREFILL_MS: every prompt
token read costs milliseconds, inside the model's layers, worker/process/step_progress.py) and the
watchdog is shortened to 2 s: before the fix, the first step (the idle burst, 2,048 tokens)
took over 4 s and the worker was killed. Real gateway, real worker, real tiny model."""

from __future__ import annotations

import os
import signal
import time

import mlx.core as mx
import pytest
from helpers import NO_EOS, openai_client, start_gateway, wait_for

SLOW_MS_PER_TOKEN = 2.0  # a host that reads at most 500 prompt tokens a second
HANG_TIMEOUT_S = 2.0
LONG_PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(220))


@pytest.fixture(scope="module")
def slow_gateway(home, tiny_dir):
    config = {
        "manager": {
            "auto_discover": False,
            "heartbeat_s": 0.25,
            "liveness": 4,
            "hang_timeout_s": HANG_TIMEOUT_S,
            "restart_backoff_s": 0.1,  # the watchdog test's restarts: not 1 s and 2 s
        },
        "models": [{"name": "slow", "source": "tiny", "preload": True, "max_num_seqs": 2}],
    }
    os.environ["MLXGW_TEST_SLOW_PREFILL_MS"] = str(SLOW_MS_PER_TOKEN)
    try:
        gw = start_gateway(home, config, "slow-host-gateway")
    finally:
        del os.environ["MLXGW_TEST_SLOW_PREFILL_MS"]
    yield gw
    gw.stop()


def _ask(gw, content: str, max_tokens: int = 3):
    return openai_client(gw, timeout=120).chat.completions.create(
        model="slow",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        extra_body={"logit_bias": NO_EOS},
    )


def test_a_long_prompt_on_a_slow_host_completes_with_no_restart(slow_gateway):
    gw = slow_gateway
    pid = gw.worker_pid("slow")
    started = time.monotonic()
    out = _ask(gw, LONG_PROMPT)
    took = time.monotonic() - started
    assert out.usage.prompt_tokens > 2048  # more than the idle burst's first step would read
    assert out.usage.completion_tokens == 3
    assert took > out.usage.prompt_tokens * SLOW_MS_PER_TOKEN / 1000  # the host really was slow
    status = gw.model_status("slow")
    assert (status["restarts"], status["watchdog_kills"]) == (0, 0), gw.log()
    assert gw.worker_pid("slow") == pid
    assert "no progress" not in gw.log()


def test_watchdog_kills_never_quarantine_the_request(slow_gateway):
    """A worker stopped twice under the same request (SIGSTOP: silent, the watchdog's kill)
    is restarted twice, counted as watchdog kills, and the request is then served."""
    gw = slow_gateway
    content = "The same request, in flight at every watchdog kill."
    for _ in range(2):
        pid = gw.worker_pid("slow")
        stream = openai_client(gw).chat.completions.create(
            model="slow",
            messages=[{"role": "user", "content": content}],
            max_tokens=30000,
            stream=True,
            extra_body={"logit_bias": NO_EOS},
        )
        next(iter(stream))
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(Exception, match="stopped"):
            for _ in stream:
                pass
        wait_for(lambda p=pid: gw.worker_pid("slow") != p, 60)
    assert _ask(gw, content).usage.completion_tokens == 3  # not refused as poison
    status = gw.model_status("slow")
    assert status["watchdog_kills"] == 2 and status["crashes"] == 0, status
    assert gw.status()["quarantined_requests"] == []
    assert "killed by the watchdog" in gw.log()


def test_prefill_reports_progress_per_layer_group_and_decode_runs_untouched(tiny_dir):
    """The real tiny model, in process: every layer group of a multi-token pass marks
    progress; a one-token decode pass marks none; the outputs are the same numbers."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxgw.worker.process.step_progress import install

    model, _ = load(str(tiny_dir))
    tokens = mx.array([[5, 17, 300, 42, 8, 99, 1000, 7]])
    expected = model(tokens, cache=make_prompt_cache(model))
    marks: list[float] = []
    progress = install(model, lambda: marks.append(time.monotonic()), long_step_s=1.0)
    per_pass = progress.marks
    assert per_pass == len(model.layers)  # two layers: one group each
    model(tokens, cache=make_prompt_cache(model))
    assert marks == []  # steps are short: no marks, no extra synchronisation
    progress.note_step(1.5)  # a long step: marks on
    got = model(tokens, cache=make_prompt_cache(model))
    assert len(marks) == per_pass
    assert mx.allclose(got, expected).item()
    cache = make_prompt_cache(model)
    model(tokens, cache=cache)
    marks.clear()
    model(mx.array([[3]]), cache=cache)  # a decode step
    assert marks == []
