"""Reranking: POST /v1/rerank (Cohere / Jina request and response shape).

Served by cross-encoders (`kind: rerank`, a relevance score per query-document pair) and by
embedding models (`kind: embedding`, cosine similarity of query and document vectors). In
both the documents are batched in the worker like embedding inputs."""

from __future__ import annotations

from aiohttp import web

from mlxgw.shared import protocol as p
from mlxgw.shared.config import ENCODER_KINDS
from mlxgw.shared.errors import invalid

from ..state import SETTINGS
from . import translate as t
from . import validate as v

routes = web.RouteTableDef()

MAX_DOCUMENTS = 1000


def parse_documents(body: dict) -> list[str]:
    """Strings, or objects with a 'text' field (Jina and Cohere v1 accept both)."""
    raw = v.required(body, "documents")
    if not isinstance(raw, list) or not raw:
        raise invalid("'documents' must be a non-empty list", "documents")
    if len(raw) > MAX_DOCUMENTS:
        raise invalid(f"'documents' takes at most {MAX_DOCUMENTS} entries, got {len(raw)}", "documents")
    docs = []
    for i, d in enumerate(raw):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str) or not text:
            raise invalid(f"documents[{i}] must be a non-empty string or an object with a 'text' string", "documents")
        docs.append(text)
    return docs


@routes.post("/v1/rerank")
@routes.post("/v2/rerank")
async def rerank(request: web.Request) -> web.Response:
    body, slot = await t.open_request(request, ENCODER_KINDS)
    query = v.string(body, "query", required_=True)
    if not query:
        raise invalid("'query' must not be empty", "query")
    docs = parse_documents(body)
    top_n = v.integer(body, "top_n", lo=1, default=len(docs))
    return_documents = v.boolean(body, "return_documents", default=True)
    req = p.EmbedRequest(
        rid=request["rid"], inputs=docs, query=query, timeout_s=request.app[SETTINGS].request_timeout_s
    )
    async with t.generation(request, slot, req) as gen:
        done = await gen.finish_event()
    ranked = sorted(enumerate(done.scores), key=lambda x: -x[1])[:top_n]
    results = []
    for index, score in ranked:
        item = {"index": index, "relevance_score": score}
        if return_documents:
            item["document"] = {"text": docs[index]}
        results.append(item)
    tokens = gen.usage.prompt_tokens
    return web.json_response(
        {
            "id": request["rid"],
            "object": "rerank",
            "model": slot.name,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"billed_units": {"search_units": 1}},
        }
    )
