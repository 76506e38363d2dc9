"""A worker never dies of its prompts' size.

A model with 0.5 MiB of KV per token once got 8 rows; four ~3,000-token prompts were all
admitted, the worker died under a 5 GiB limit and every request on it got 502. Here a tiny
random llama with 1 MiB of KV per token (16 layers x 16 KV heads x head_dim 512, float32;
hidden size 16, so its weights are ~35 MB and a step costs little) is served by a real
`mlxgw up` whose processes run under an address-space limit (RLIMIT_AS, inherited by the
worker), with max_num_seqs 8. mlx-lm allocates KV 256 tokens at a time, so every short
request's row holds 256 MiB: six at once need 1.5 GiB, more than the worker has left (before
admission by memory the worker died of it, exit 1 or SIGSEGV, with a 502 for every request,
the short ones alone too). The worker measures its budget from the limit; sent at once over
HTTP, every request is answered (those that do not fit beside the others wait) or, for the
one that cannot fit even alone, refused with a 400 that names the numbers; the worker
process is the same at the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import openai_client, start_gateway, wait_for

from mlxgw.shared.platform import IS_LINUX

pytestmark = pytest.mark.skipif(not IS_LINUX, reason="RLIMIT_AS bounds a process's memory on Linux only")

KV_HEAVY = {
    "hidden_size": 16,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 512,
    "intermediate_size": 32,
}
MIB_PER_TOKEN = 16 * 16 * 512 * 2 * 4 >> 20  # 1
# A loaded worker's address space is ~1.2 GB here: this leaves it ~1.3 GB, a KV budget of
# about two short rows (half the room, worker/model/memory/kv_budget.py), and six rows (1.5 GiB) no room.
ADDRESS_SPACE = int(2.5 * (1 << 30))
SHORT = 5  # requests sent at once with a short prompt (each row: 256 tokens' slots, 256 MiB)
ROW_BYTES = 256 * MIB_PER_TOKEN << 20


@pytest.fixture(scope="module")
def gateway(home, smollm2_dir):
    from tiny_model import build_tiny_model

    build_tiny_model(home / "models" / "kv-heavy", smollm2_dir, overrides=KV_HEAVY)
    config = {
        "manager": {"auto_discover": False},
        "models": [{"name": "kv-heavy", "preload": True, "max_num_seqs": 8}],
    }
    gw = start_gateway(home, config, "kv-limit-gateway", address_space=ADDRESS_SPACE)
    yield gw
    gw.stop()


def _ask(client, i: int) -> tuple[int, str]:
    """(HTTP status, answer text or error message) of one chat request."""
    # One request's prompt alone needs ~1 GiB of KV (1,200 tokens): more than the whole budget.
    content = "the " * 1200 if i == 0 else f"Say something about the number {i}."
    try:
        r = client.chat.completions.create(
            model="kv-heavy", messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0
        )
        return 200, r.choices[0].message.content or ""
    except openai.APIStatusError as e:
        return e.status_code, str(e.message)


def _worker_stats(gateway) -> dict:
    return wait_for(lambda: gateway.model_status("kv-heavy")["workers"][0].get("stats"))


def test_long_and_concurrent_prompts_are_queued_or_refused_and_the_worker_lives(gateway):
    pid = gateway.worker_pid("kv-heavy")
    kv = _worker_stats(gateway).get("kv")  # (absent before admission by memory)
    if kv is not None and kv["budget_bytes"] < ROW_BYTES:
        pytest.skip(f"a loaded worker takes most of {ADDRESS_SPACE >> 20} MiB of address space on this host: {kv}")
    client = openai_client(gateway, timeout=180)
    with ThreadPoolExecutor(SHORT + 1) as pool:
        results = list(pool.map(lambda i: _ask(client, i), range(SHORT + 1)))
    huge, short = results[0], results[1:]
    assert all(status == 200 for status, _ in short), short  # every short one answered, some after waiting
    status, message = huge
    assert status == 400, huge  # the request's own fault, in the API's shape: never a 502
    assert "KV" in message and "MiB" in message and "prompt tokens" in message, message
    model = gateway.model_status("kv-heavy")
    assert gateway.worker_pid("kv-heavy") == pid
    assert model["crashes"] == 0 and model["restarts"] == 0, model
    kv = model["workers"][0]["stats"]["kv"]
    assert kv["source"] == "RLIMIT_AS", kv  # measured from the limit, not RAM
    assert kv["bytes_per_token"] == MIB_PER_TOKEN << 20
    assert kv["reserved_bytes"] <= kv["budget_bytes"] and kv["refused"] == 1, kv


def test_anthropic_clients_read_a_prompt_too_long_for_memory_as_prompt_is_too_long(gateway):
    """Claude Code compacts its conversation when it reads "prompt is too long"."""
    import anthropic

    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="kv-heavy", max_tokens=16, messages=[{"role": "user", "content": "the " * 1200}])
    assert "prompt is too long" in str(refused.value), refused.value
