"""GET /v1/audit: the audit trail for admins (gateway/access/audit), filtered, as JSON or as
JSON lines for export (`?format=jsonl` or `Accept: application/x-ndjson`), with the chain's
verification on `?verify=true`."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError
from ...access.audit import AUDIT
from ...access.audit.store import matches
from ...access.usage import UsageQueryError, parse_since
from .keys import require_admin

routes = web.RouteTableDef()
FILTERS = ("actor", "action", "target", "outcome")
MAX_LIMIT = 10000


def _limit(text: str | None) -> int:
    if text is None:
        return 100
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"'limit' must be 1..{MAX_LIMIT}", param="limit")
    return int(text)


def _since(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_since(text)
    except UsageQueryError as e:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), param="since") from None


@routes.get("/v1/audit")
async def audit_trail(request: web.Request) -> web.StreamResponse:
    """The newest `limit` entries that match, oldest first (as the file is)."""
    require_admin(request)
    q = request.query
    since, limit = _since(q.get("since")), _limit(q.get("limit"))
    wanted = {f: q.get(f) or None for f in FILTERS}
    audit = request.app[AUDIT]
    entries = await asyncio.to_thread(audit.entries)
    found = [e for e in entries if matches(e, since, **wanted)][-limit:]
    jsonl = q.get("format") == "jsonl" or "application/x-ndjson" in request.headers.get("Accept", "")
    if jsonl:
        text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in found)
        return web.Response(text=text, content_type="application/x-ndjson")
    out = {"object": "list", "data": found, "file": str(audit.path)}
    if q.get("verify") in ("1", "true"):
        out["verify"] = await asyncio.to_thread(audit.verify)
    return web.json_response(out)
