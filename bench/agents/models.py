"""Which chat model fits the agent clients on this host (item 4).

Sends each recorded agent request (tests/fixtures: Claude Code over the Anthropic API, Codex
over the Responses API) to each model of a running gateway, greedy and with a short answer,
and reports per model and request: prompt tokens, time to the first token (prefill rate),
decode rate, whether the answer was a tool call, and which tool. The context fit of longer
clients' first prompts (Qwen Code 9.5k tokens) is read from the models' context lengths.

    python bench/agents/models.py --url http://127.0.0.1:8000 --models smollm2-135m qwen2.5-coder-0.5b

Traffic goes only to the given gateway (127.0.0.1); each request is bounded by --timeout."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
RECORDED = {
    "claude_code": ("claude_code_request.json", "/v1/messages"),
    "codex": ("codex_request.json", "/v1/responses"),
}


def recorded(name: str, model: str, max_tokens: int) -> tuple[str, dict]:
    file, path = RECORDED[name]
    body = json.loads((FIXTURES / file).read_text())
    body = dict(body, model=model, stream=True, temperature=0)
    for key in ("thinking", "context_management", "output_config", "metadata", "reasoning", "include"):
        body.pop(key, None)
    if path == "/v1/messages":
        body["max_tokens"] = max_tokens
    else:
        body["max_output_tokens"] = max_tokens
    return path, body


def run_one(client: httpx.Client, url: str, path: str, body: dict, timeout: float) -> dict:
    started = time.monotonic()
    first = None
    text, tools, usage = "", [], {}
    with client.stream("POST", url + path, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read().decode()[:300]}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            kind = ev.get("type", "")
            if first is None and kind in ("content_block_delta", "content_block_start", "response.output_text.delta"):
                first = time.monotonic()
            if kind == "content_block_start" and ev["content_block"].get("type") == "tool_use":
                tools.append(ev["content_block"]["name"])
            if kind == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                text += ev["delta"]["text"]
            if kind == "response.output_text.delta":
                text += ev["delta"]
            if kind == "response.output_item.done" and ev["item"].get("type") == "function_call":
                tools.append(ev["item"]["name"])
            if kind == "message_delta":
                usage.update(ev.get("usage") or {})
            if kind == "message_start":
                usage.update(ev["message"].get("usage") or {})
            if kind == "response.completed" or kind == "response.incomplete":
                u = ev["response"].get("usage") or {}
                usage.update(input_tokens=u.get("input_tokens"), output_tokens=u.get("output_tokens"))
    done = time.monotonic()
    first = first or done
    out_tokens = usage.get("output_tokens") or 0
    return {
        "status": 200,
        "prompt_tokens": usage.get("input_tokens"),
        "ttft_s": round(first - started, 1),
        "prefill_tok_s": round((usage.get("input_tokens") or 0) / max(first - started, 1e-6), 1),
        "decode_tok_s": round(max(out_tokens - 1, 0) / max(done - first, 1e-6), 2),
        "output_tokens": out_tokens,
        "tool_calls": tools,
        "text": text[:160],
        "wall_s": round(done - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--requests", nargs="+", default=list(RECORDED))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    with httpx.Client() as client:
        info = client.get(args.url + "/v1/models").json()["data"]
        print(json.dumps({m["id"]: m.get("context_length") for m in info if m["id"] in args.models}))
        for model in args.models:
            for name in args.requests:
                path, body = recorded(name, model, args.max_tokens)
                result = run_one(client, args.url, path, body, args.timeout)
                print(json.dumps({"model": model, "request": name, **result}), flush=True)


if __name__ == "__main__":
    main()
