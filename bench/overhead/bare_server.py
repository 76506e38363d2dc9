"""The floor the gateway's capacity is measured against: one aiohttp process whose handler
parses the JSON body and answers POST /v1/chat/completions at once, in the gateway's own
shapes (a completion body, or one `chat.completion.chunk` per token, the usage chunk,
[DONE]): the least any OpenAI-compatible Python server does.

    python -m mlxgw.bench.overhead.bare_server PORT

bench/servers.py starts it (spawn_bare) for bench/overhead/capacity.py."""

from __future__ import annotations

import json
import os
import sys
import time

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]


def bare_app():
    """A plain aiohttp handler with the gateway's output shapes: what mlxgw is measured against."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        cid, created = f"chatcmpl-{os.urandom(12).hex()}", int(time.time())
        usage = {
            "prompt_tokens": 8,
            "completion_tokens": n,
            "total_tokens": 8 + n,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        if not body.get("stream"):
            text = "".join(WORDS[(8 + i) % len(WORDS)] + " " for i in range(n))
            return web.json_response(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "logprobs": None,
                            "message": {"role": "assistant", "content": text, "refusal": None},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            choice = {"index": 0, "logprobs": None, "delta": delta, "finish_reason": finish}
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body["model"]}
            text = json.dumps({**obj, "choices": [choice], "usage": None}, separators=(",", ":"))
            return f"data: {text}\n\n".encode()

        await resp.write(chunk({"role": "assistant", "content": ""}))
        for i in range(n):
            await resp.write(chunk({"content": WORDS[(8 + i) % len(WORDS)] + " "}))
        await resp.write(chunk({}, "length"))
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body["model"]}
        await resp.write(f"data: {json.dumps({**obj, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def serve_bare(port: int) -> None:
    from aiohttp import web

    web.run_app(bare_app(), host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    serve_bare(int(sys.argv[1]))
