"""`mlxgw up`: serve until SIGINT/SIGTERM, then drain and stop every worker."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from shared import paths
from shared.config import Registry

from .app import default_endpoint, make_app
from .state import MANAGER, GatewaySettings

log = logging.getLogger("mlxgw.gateway")


async def serve(
    registry: Registry, settings: GatewaySettings, host: str, port: int, endpoint: str | None = None, secret: str = ""
) -> None:
    endpoint = endpoint or default_endpoint(paths.run_dir())
    app = make_app(registry, settings, endpoint, secret)
    log.info("worker link endpoint %s", endpoint)
    # Cancel a handler when its client disconnects: a gone client frees its sequence.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: reachable from other machines", host)
    await app[MANAGER].wait_preloaded()
    print(f"mlxgw ready on http://{host}:{port}", flush=True)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def run(registry: Registry, settings: GatewaySettings, host: str, port: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(registry, settings, host, port))
