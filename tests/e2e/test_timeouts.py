"""A request has two time bounds: queue + prompt processing until its first token
(gateway.prefill_timeout_s), then the answer, counted from the first token
(gateway.request_timeout_s). A long wait for a turn or a long prefill never eats the time the
answer has, and a request that never gets a turn is still ended."""

from __future__ import annotations

import threading

import pytest
from helpers import NO_EOS, http, openai_client, start_gateway, wait_for

SERIAL = {"name": "serial", "source": "tiny", "max_num_seqs": 1, "max_queue": 8, "preload": True}
MSGS = [{"role": "user", "content": "Write a very long story."}]


# 16-token prefill chunks: a long prompt takes many steps, so its progress can be watched
CHUNKY = {"name": "chunky", "source": "tiny", "prefill_step_size": 16, "preload": True}


def _config(request_timeout_s: float, prefill_timeout_s: float, models: tuple = (SERIAL, CHUNKY)) -> dict:
    return {
        "manager": {"auto_discover": False},
        "gateway": {"request_timeout_s": request_timeout_s, "prefill_timeout_s": prefill_timeout_s},
        "models": list(models),
    }


def _endless(gw, outcome: dict, rid: str | None = None, model: str = "serial") -> threading.Thread:
    """A stream that never stops by itself, on the one-row model; records how it ended."""
    headers = {"x-request-id": rid} if rid else None

    def run() -> None:
        stream = openai_client(gw).chat.completions.create(
            model=model,
            messages=MSGS,
            max_tokens=30000,
            stream=True,
            extra_body={"logit_bias": NO_EOS},
            extra_headers=headers,
        )
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome["finish_reason"] = chunk.choices[0].finish_reason
            outcome["end"] = "finished"
        except Exception as e:  # the SDK raises on the SSE error event that ends the stream
            outcome["end"] = str(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def answer_bound_gw(home, tiny_dir):
    gw = start_gateway(home, _config(request_timeout_s=2, prefill_timeout_s=120), "timeouts-answer")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def prefill_bound_gw(home, tiny_dir):
    # its one test uses the one-row model only: no second worker to load beside it
    gw = start_gateway(home, _config(request_timeout_s=120, prefill_timeout_s=2, models=(SERIAL,)), "timeouts-prefill")
    yield gw
    gw.stop()


def test_waiting_for_a_turn_does_not_count_against_the_answer(answer_bound_gw):
    """Two endless streams ahead on a one-row model each end 2 s after their first token; the
    request behind them waits about 4 s, more than the 2 s an answer has, and still completes."""
    outcomes = [{}, {}]
    threads = [_endless(answer_bound_gw, outcome) for outcome in outcomes]
    wait_for(lambda: _running_and_waiting(answer_bound_gw) == 2, 30)
    status, _, body = http(
        f"{answer_bound_gw.url}/v1/chat/completions",
        "POST",
        {"model": "serial", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120,
    )
    for t in threads:
        t.join(60)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1
    for outcome in outcomes:  # each answer ended at its time limit, with what it had generated
        assert outcome == {"end": "finished", "finish_reason": "length"}


def test_a_request_that_gets_no_first_token_in_time_is_a_504(prefill_bound_gw):
    outcome: dict = {}
    thread = _endless(prefill_bound_gw, outcome, "req_endless_holder")
    wait_for(lambda: _running_and_waiting(prefill_bound_gw) == 1, 30)  # it holds the one row
    try:
        status, _, body = http(
            f"{prefill_bound_gw.url}/v1/chat/completions",
            "POST",
            {"model": "serial", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        )
        assert status == 504, body
        assert "no first token within 2 s" in body["error"]["message"]
    finally:
        # Cancelled, not left to the shutdown: a graceful stop gives streams in flight up to
        # a minute to finish, and this one never would.
        http(f"{prefill_bound_gw.url}/v1/requests/req_endless_holder/cancel", "POST", {})
        thread.join(30)
        prefill_bound_gw.stop()


def _running_and_waiting(gw) -> int:
    stats = [w.get("stats") or {} for w in gw.model_status("serial")["workers"]]
    return sum(s.get("running", 0) + s.get("waiting", 0) for s in stats)


def test_a_long_prefill_reports_its_progress_in_status(answer_bound_gw):
    """Operators (and agent users waiting on a slow host) see how far a prefill has got."""
    # ~9,000 tokens in 16-token chunks: seconds of prefill, several heartbeats' stats during it
    content = " ".join(f"word{i}" for i in range(2000))
    body = {"model": "chunky", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    reply: dict = {}
    thread = threading.Thread(
        target=lambda: reply.update(r=http(f"{answer_bound_gw.url}/v1/chat/completions", "POST", body, timeout=300))
    )
    thread.start()
    seen: list[dict] = []

    def prefilling() -> bool:
        for worker in answer_bound_gw.model_status("chunky")["workers"]:
            for r in (worker.get("stats") or {}).get("requests", []):
                if r["phase"] == "prefill" and 0 < r["prefilled_tokens"] < r["prompt_tokens"]:
                    seen.append(r)
        return len(seen) >= 2

    wait_for(prefilling, 120, interval=0.2)
    thread.join(300)
    assert reply["r"][0] == 200
    assert seen[-1]["prefilled_tokens"] >= seen[0]["prefilled_tokens"]


def test_the_answer_time_limit_returns_the_answer_in_every_api_shape(answer_bound_gw):
    """At the 2-s answer bound each API gets the text generated so far: Chat Completions
    finish_reason length; the agents' APIs end the turn (Anthropic end_turn, Responses
    completed), since Claude Code takes max_tokens as a cue to ask for more and Codex takes
    incomplete for an error (gateway/api/anthropic/messages.py _stop, responses_output.py finish)."""
    import anthropic

    gw = answer_bound_gw
    results: dict = {}
    ask = {"max_tokens": 30000, "extra_body": {"logit_bias": NO_EOS}}
    ask_body = {"extra_body": ask["extra_body"]}

    def chat() -> None:
        out = openai_client(gw, timeout=60).chat.completions.create(model="chunky", messages=MSGS, **ask)
        results["chat"] = (out.choices[0].finish_reason, out.usage.completion_tokens, out.choices[0].message.content)

    def messages() -> None:
        client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
        out = client.messages.create(model="chunky", messages=MSGS, **ask)
        results["anthropic"] = (out.stop_reason, out.usage.output_tokens, out.content[0].text)
        with client.messages.stream(model="chunky", messages=MSGS, **ask) as stream:
            final = stream.get_final_message()
        results["anthropic-stream"] = (final.stop_reason, final.usage.output_tokens, final.content[0].text)

    def responses() -> None:
        out = openai_client(gw, timeout=60).responses.create(
            model="chunky", input="Write a very long story.", max_output_tokens=30000, **ask_body
        )
        results["responses"] = (out.status, out.usage.output_tokens, out.output_text)
        stream = openai_client(gw, timeout=60).responses.create(
            model="chunky", input="Write a very long story.", max_output_tokens=30000, stream=True, **ask_body
        )
        final = [e.response for e in stream if e.type.startswith("response.") and hasattr(e, "response")][-1]
        results["responses-stream"] = (final.status, final.usage.output_tokens, final.output_text)

    threads = [threading.Thread(target=fn) for fn in (chat, messages, responses)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert {k: v[0] for k, v in results.items()} == {
        "chat": "length",
        "anthropic": "end_turn",
        "anthropic-stream": "end_turn",
        "responses": "completed",
        "responses-stream": "completed",
    }, results
    for _, tokens, text in results.values():
        assert tokens > 0 and text
    assert "time_limited=True" in gw.log()
