"""Vision rows are admitted by KV memory, as text rows are.

A real `mlxgw up` serves the tests' tiny random Qwen2-VL (2 layers x 2 KV heads x head_dim
16, float32: 512 bytes of KV per token) with kv_memory_mb 1: 2,048 tokens. A row with an
image cannot be paused (its embeddings are not kept), so it reserves its whole reach, its
prompt (the image's tokens included) + max_tokens, rounded up to mlx-vlm's 256-token KV
slots (and 16 tokens a draft may add): a ~450-token prompt with max_tokens 120 takes 768
tokens' slots, so two such rows fit the budget and a third does not (long prompts, short
answers: reading a prompt costs a fraction of generating as many tokens). Before, vision
models had no KV budget (no stats.kv) and every row was admitted at once, up to
max_num_seqs; now the rows beyond the budget wait for room and every request is answered."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import openai_client, start_gateway, wait_for

pytest.importorskip("mlx_vlm", reason="vision tests need the vision extra (pip install -e '.[test,vision]')")

from test_vision import chat_with_image, data_url, png  # noqa: E402  (after the skip: Pillow comes with it)

BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head_dim x (keys, values) x float32
ANSWER = 120  # tokens each concurrent request generates: 768 tokens' slots with its prompt
AT_ONCE = 4  # requests sent together; two fit the budget
SLOT, SLACK = 256, 16  # mlx-vlm's KV grows in slots of 256 tokens; a draft may hold 16 more
FILLER = " Describe every detail." * 100  # 400 tokens of prompt: a row reaches 2 slots + a bit


@pytest.fixture(scope="module")
def gw(home, tiny_vision_dir):
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {
                "name": "tiny-vision",
                "kind": "vision",
                "preload": True,
                "max_num_seqs": 8,
                "cache": {"kv_memory_mb": 1},
                "max_tokens_policy": "reject",
            }
        ],
    }
    gw = start_gateway(home, config, "vision-kv-gateway")
    yield gw
    gw.stop()


def _kv(gw) -> dict | None:
    def engine_stats():  # the engine's own, not the load's
        stats = gw.model_status("tiny-vision")["workers"][0].get("stats") or {}
        return stats if "running" in stats else None

    return wait_for(engine_stats).get("kv")


def _no_eos(model_dir) -> dict:
    """Every row generates exactly its max_tokens: the model's end tokens are masked."""
    config = json.loads((model_dir / "config.json").read_text())
    return {str(t): -100 for t in config["eos_token_id"]}


def test_a_vision_worker_shows_its_kv_budget_measured_from_the_language_model(gw):
    kv = _kv(gw)
    assert kv is not None, "a vision worker admits rows by KV memory (stats.kv)"
    assert kv["budget_bytes"] == 1 << 20 and kv["source"] == "models.yaml kv_memory_mb", kv
    assert kv["bytes_per_token"] == BYTES_PER_TOKEN and kv["layers"] == {"grows": 2}, kv


def _stream(client, bias: dict, i: int) -> tuple[float, float, int, int]:
    """(first content at, end at, completion tokens, prompt tokens) of one streamed image request."""
    stream = client.chat.completions.create(
        model="tiny-vision",
        messages=chat_with_image(data_url(png(color=(40 * i, 90, 200))), f"Picture {i}: what is in it?{FILLER}"),
        max_tokens=ANSWER,
        logit_bias=bias,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, tokens, prompt = None, 0, 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
        if chunk.usage is not None:
            tokens, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    end = time.monotonic()
    return first or end, end, tokens, prompt


def test_image_requests_beyond_the_kv_budget_wait_for_room_and_are_all_answered(gw, tiny_vision_dir):
    pid = gw.worker_pid("tiny-vision")
    client = openai_client(gw, timeout=300)
    bias = _no_eos(tiny_vision_dir)
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda i: _stream(client, bias, i), range(AT_ONCE)))
    assert [tokens for _, _, tokens, _ in results] == [ANSWER] * AT_ONCE, results  # every one answered in full
    reach = max(prompt for *_, prompt in results) + ANSWER + SLACK
    assert 2 * SLOT < reach <= 3 * SLOT, f"each row must take 3 slots for 2 to fit, not 3: {reach} tokens"
    # Two rows fit at once: the others started only after one of the first had ended.
    first_end = min(end for _, end, _, _ in results)
    waited = [first for first, *_ in results if first >= first_end]
    assert len(waited) >= AT_ONCE - 2, results
    model = gw.model_status("tiny-vision")
    assert gw.worker_pid("tiny-vision") == pid and model["crashes"] == 0, model
    kv = model["workers"][0]["stats"]["kv"]
    assert kv["refused"] == 0 and kv["reserved_bytes"] <= kv["budget_bytes"], kv


def test_an_image_request_that_cannot_fit_alone_is_refused_counting_its_image_tokens(gw):
    messages = chat_with_image(data_url(png()))
    fits = openai_client(gw).chat.completions.create(model="tiny-vision", messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(gw).chat.completions.create(model="tiny-vision", messages=messages, max_tokens=3000)
    message = str(refused.value)
    assert "KV" in message and "MiB" in message, message
    # the prompt the budget counted is the one usage reports: the image's tokens included
    assert f"{fits.usage.prompt_tokens} prompt tokens + max_tokens 3000" in message, message
    wait_for(lambda: _kv(gw)["refused"] >= 1, timeout=10)  # counted (stats travel with heartbeats)


def _text(client, bias: dict, i: int) -> tuple[int, int]:
    r = client.chat.completions.create(
        model="tiny-vision",
        messages=[{"role": "user", "content": f"Tell story {i}." + " Describe every detail." * 25}],
        max_tokens=TEXT_ANSWER,
        logit_bias=bias,
    )
    return r.usage.completion_tokens, r.usage.prompt_tokens


# Six text rows of ~140 prompt tokens fit at their start (prompt + a 64-token allowance + the
# 16-token slack: one slot each), not once they grow past it (two slots each: 1.5 MiB).
TEXT_ANSWER = 160
ALLOWANCE = 64  # worker/model/memory/kv_budget.py DECODE_ALLOWANCE


def test_text_rows_of_a_vision_model_paused_for_memory_resume_and_finish(gw, tiny_vision_dir):
    """Rows without images are admitted on what they hold and paused when they outgrow the
    budget; a paused row re-enters the vision runner as plain token ids and finishes."""
    before = _kv(gw)["preempted"]
    client = openai_client(gw, timeout=300)
    bias = _no_eos(tiny_vision_dir)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: _text(client, bias, i), range(6)))
    assert [tokens for tokens, _ in answers] == [TEXT_ANSWER] * 6, answers
    prompt = max(p for _, p in answers)
    assert prompt + ALLOWANCE + SLACK <= SLOT < prompt + TEXT_ANSWER + SLACK, f"six fit at first, not grown: {prompt}"
    wait_for(lambda: _kv(gw)["preempted"] > before, timeout=10)
