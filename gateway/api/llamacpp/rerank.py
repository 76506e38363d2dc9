"""Reranking: POST /v1/rerank (Cohere / Jina request and response shape).

Served by cross-encoders (`kind: rerank`, a relevance score per query-document pair) and by
embedding models (`kind: embedding`, cosine similarity of query and document vectors). In
both the documents are batched in the worker like embedding inputs."""

from __future__ import annotations

from aiohttp import web

from ....shared import protocol as p
from ....shared.errors import invalid
from ....shared.model_sections import ENCODER_KINDS
from ...pipeline.aux_fields import RerankFields, required
from ...pipeline.serving import generation, open_fields
from ...web.state import SETTINGS

routes = web.RouteTableDef()

MAX_DOCUMENTS = 1000


def parse_documents(raw) -> list[str]:
    """Strings, or objects with a 'text' field (Jina and Cohere v1 accept both)."""
    required(raw, "documents")
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
    f, slot = await open_fields(request, RerankFields, ENCODER_KINDS)
    query = required(f.query, "query")
    if not query:
        raise invalid("'query' must not be empty", "query")
    docs = parse_documents(f.documents)
    top_n = len(docs) if f.top_n is None else f.top_n
    return_documents = f.return_documents is not False
    req = p.EmbedRequest(
        rid=request["rid"], inputs=docs, query=query, timeout_s=request.app[SETTINGS].request_timeout_s
    )
    async with generation(request, slot, req) as gen:
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
