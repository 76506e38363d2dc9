"""Eight agent sessions growing far past a worker's KV budget: every request answered, no
worker death, and rows preempted to the prefix store rather than held back.

A real `mlxgw up` serves the tiny llama (512 bytes of KV per token) with kv_memory_mb 1: a
budget of 2,048 tokens, eight of mlx-lm's 256-token row slots. Eight sessions run at once
over HTTP, each a conversation whose prompt grows turn by turn (its answers kept in it) to
about 1,700 tokens, near the most one request may hold alone: their contexts together are
~7x the budget, and the KV of all their turns ~18x. Their first two turns ask for 100-token
answers: rows are admitted on what they hold (prompt + a 64-token allowance), so up to eight
first turns run at once and, as they grow past their slot, the latest are paused to the
prefix store and resume when the others end (reserving prompt + max_tokens ran them four at
a time, never pausing one). The worker counts those pauses in its status (stats.kv.preempted)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import NO_EOS, openai_client, start_gateway, wait_for

SESSIONS = 8
WORDS = "the team reads code and writes tests for every change it makes to the service".split()
# (words the user adds, max_tokens of the answer) per turn: long answers while the prompts are
# short (rows grow past their slots), then long turns with short answers (the context grows).
TURNS = [(130, 100), (170, 100), (600, 8), (600, 8)]


@pytest.fixture(scope="module")
def gateway(home, tiny_dir):
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "tiny-kv", "source": "tiny", "preload": True, "max_num_seqs": 8, "cache": {"kv_memory_mb": 1}}
        ],
    }
    gw = start_gateway(home, config, "kv-preemption-gateway")
    yield gw
    gw.stop()


def _session(client, i: int) -> list[tuple[int, int]]:
    """One conversation, turn after turn: each turn's (prompt tokens, answer tokens)."""
    messages: list[dict] = [{"role": "system", "content": f"You are agent {i} of the team."}]
    usage = []
    for turn, (words, max_tokens) in enumerate(TURNS):
        text = " ".join(WORDS[(i + turn + j) % len(WORDS)] for j in range(words))
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(
            model="tiny-kv", messages=messages, max_tokens=max_tokens, temperature=0, logit_bias=NO_EOS
        )
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        usage.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    return usage


def test_eight_sessions_growing_past_the_kv_budget_are_all_answered_and_the_worker_lives(gateway):
    pid = gateway.worker_pid("tiny-kv")
    client = openai_client(gateway, timeout=120)
    with ThreadPoolExecutor(SESSIONS) as pool:  # an APIStatusError (a 400, a 502) fails the test
        sessions = list(pool.map(lambda i: _session(client, i), range(SESSIONS)))
    assert all(len(turns) == len(TURNS) for turns in sessions)
    for turns in sessions:  # every answer whole: nothing cut to fit, nothing lost to a pause
        assert [answer for _, answer in turns] == [max_tokens for _, max_tokens in TURNS], turns
    model = gateway.model_status("tiny-kv")
    assert gateway.worker_pid("tiny-kv") == pid
    assert model["crashes"] == 0 and model["restarts"] == 0, model

    def kv() -> dict:
        return (gateway.model_status("tiny-kv")["workers"][0].get("stats") or {}).get("kv") or {}

    wait_for(lambda: kv().get("preempted", 0) > 0 and not kv().get("rows"), 15)
    counters = kv()
    budget_tokens = counters["budget_bytes"] // counters["bytes_per_token"]
    final = sum(turns[-1][0] + turns[-1][1] for turns in sessions)
    assert final >= 6 * budget_tokens, (final, budget_tokens)  # the sessions' contexts, together
    assert counters["refused"] == 0 and counters["clamped"] == 0, counters
