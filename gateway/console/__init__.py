"""The web console at /ui: static files shipped in the package, no build step, no CDN.

The page itself is public (a browser cannot send a bearer key for a page load); everything
it shows comes from the API with the admin key the operator types in, kept in the tab's
sessionStorage, or with the session cookie of a sign-in with the team's identity provider
(signin.js; gateway/access/signin/). A Content-Security-Policy keeps the page to its own origin."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError

STATIC = Path(__file__).parent
FILES = {
    "index.html": "text/html",
    "console.js": "text/javascript",
    "replicas.js": "text/javascript",
    "keys.js": "text/javascript",
    "batches.js": "text/javascript",
    "audit.js": "text/javascript",
    "playground.js": "text/javascript",
    "signin.js": "text/javascript",
    "console.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
routes = web.RouteTableDef()


@routes.get("/ui")
async def ui_root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


@routes.get("/ui/{name:[^/]*}")
async def ui_file(request: web.Request) -> web.Response:
    name = request.match_info["name"] or "index.html"
    if name not in FILES:  # a fixed list: no path from the URL ever reaches the filesystem
        raise ServiceError(ErrorCode.NOT_FOUND, f"no console file {name!r}")
    return web.Response(
        body=(STATIC / name).read_bytes(),
        content_type=FILES[name],
        headers={
            "Content-Security-Policy": CSP,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )
