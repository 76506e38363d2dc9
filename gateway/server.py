"""`mlxgw up`: serve until SIGINT/SIGTERM, then drain and stop every worker.

SIGHUP (or `mlxgw reload`) re-reads the registry file: a file with errors is rejected
whole and the running configuration stays. The port is checked before any worker starts,
and run files a killed gateway left behind are cleaned first (gateway/runfiles.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from ..shared import model_store, paths
from ..shared.config import ConfigError, Registry, load_registry, with_discovered_models
from .access.audit import record_event
from .app import default_endpoint, make_app
from .models.lifecycle import SlotState
from .models.registry_edit import clean_after_kill
from .pipeline.observe import access_log
from .runfiles import PortBusy, check_port, clean_stale_run_files, remove_pid_file, write_pid_file
from .web.edge import EdgeRunner, edge_limits
from .web.logcap import install_log_limits
from .web.state import MANAGER, GatewaySettings

# How long a graceful stop waits for the requests in flight (aiohttp's own default).
SHUTDOWN_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)
# A signal carries no identity: whoever may signal the gateway (its OS user, root) reloaded it.
SIGNAL_ACTOR = {"kind": "signal", "signal": "SIGHUP"}


async def reload_registry(app: web.Application, config_path: Path | None) -> None:
    if config_path is None:
        log.warning("reload asked, but the gateway was started without a registry file")
        return
    try:
        registry = with_discovered_models(load_registry(config_path))
    except ConfigError as e:
        log.error("reload rejected, keeping the running registry: %s", e)
        await record_event(app, "registry.reload", str(config_path), {}, actor=SIGNAL_ACTOR, reason=str(e))
        return
    changes = await app[MANAGER].reload(registry)
    await record_event(app, "registry.reload", str(config_path), changes, actor=SIGNAL_ACTOR)


def _clean_after_kill(registry: Registry) -> None:
    """What a killed gateway's model edits left: temp files beside models.yaml, half-written
    imports and set-aside folders in the models directories."""
    if registry.path is not None:
        for stale in clean_after_kill(Path(registry.path)):
            log.info("removed %s, left by an edit that was killed", stale)
    for directory in {registry.models_dir.resolve(), model_store.models_dir().resolve()}:
        model_store.clean_stale_temp_dirs(directory)


async def serve(
    registry: Registry,
    settings: GatewaySettings,
    host: str,
    port: int,
    *,
    config_path: Path | None = None,
    extra_endpoints: tuple[str, ...] = (),
    secret: str = "",
) -> None:
    try:
        check_port(host, port)  # before any worker starts
    except PortBusy as e:
        log.error("%s; is another gateway running? (`mlxgw status --url http://%s:%d`)", e, host, port)
        raise SystemExit(2) from None
    clean_stale_run_files()
    _clean_after_kill(registry)
    endpoint = default_endpoint(paths.run_dir())
    app = make_app(registry, settings, endpoint, secret, extra_endpoints)
    log.info("worker link endpoint %s", endpoint)
    for extra in extra_endpoints:
        log.info("remote workers may connect to %s", extra)
    install_log_limits(asyncio.get_running_loop())
    limits = edge_limits(
        settings.max_connections, settings.header_timeout_s, settings.idle_timeout_s, settings.body_timeout_s
    )
    # Cancel a handler when its client disconnects: a gone client frees its sequence.
    runner = EdgeRunner(app, limits, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:  # lost a race for the port after the check: stop the workers again
        log.error("cannot listen on %s:%d: %s", host, port, e.strerror)
        await runner.cleanup()
        raise SystemExit(2) from None
    from .batches.runner import SELF_URL, quiesce_batches

    loopback = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    app[SELF_URL]["url"] = f"http://{'[' + loopback + ']' if ':' in loopback else loopback}:{port}"  # batch runner
    stop = asyncio.Event()
    reloads: set[asyncio.Task] = set()  # owned: awaited before the workers stop

    def on_sighup() -> None:
        task = asyncio.create_task(reload_registry(app, config_path))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: reachable from other machines", host)
    pid_path = write_pid_file(port)
    announcer = asyncio.create_task(announce_ready(app[MANAGER], f"http://{host}:{port}"))
    try:
        await stop.wait()
        announcer.cancel()
        log.info("shutting down")
        await asyncio.gather(*reloads, return_exceptions=True)
        # Batch requests in flight finish and are recorded while the gateway still listens:
        # the same bound as aiohttp gives the interactive handlers in runner.cleanup().
        await quiesce_batches(app, SHUTDOWN_TIMEOUT_S)
        await runner.cleanup()
    finally:
        remove_pid_file(pid_path)


def _preloaded(manager) -> list:
    return [s for s in manager.slots.values() if s.entry.preload and not s.entry.remote_only]


async def announce_ready(manager, url: str) -> None:
    """A line per preloaded model when it is ready (or failed), and the ready line once they
    all are; past the load timeout, "ready; loading N models" and the rest as they come."""
    deadline = asyncio.get_running_loop().time() + manager.registry.manager.load_timeout_s
    told: set[str] = set()
    ready_said = False
    while True:
        for slot in _preloaded(manager):
            if slot.name in told:
                continue
            if slot.state is SlotState.READY:
                took = f" in {slot.load_seconds:.1f} s" if slot.load_seconds is not None else ""
                print(f"mlxgw: model {slot.name} ready{took}", flush=True)
                told.add(slot.name)
            elif slot.state is SlotState.FAILED or slot.load_error is not None:
                print(f"mlxgw: model {slot.name} failed to load: {slot.last_error or slot.load_error}", flush=True)
                told.add(slot.name)
        loading = [s.name for s in _preloaded(manager) if s.name not in told]
        left = deadline - asyncio.get_running_loop().time()
        if not ready_said and (not loading or left <= 0):
            note = f"; loading {len(loading)} models ({', '.join(loading)})" if loading else ""
            print(f"mlxgw ready on {url}{note}", flush=True)
            ready_said = True
        if not loading:
            return
        await manager.changed.wait(left if left > 0 else None)


def run(registry: Registry, settings: GatewaySettings, host: str, port: int, **kwargs) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # No format here shows a record's source file or line: don't walk the stack for them on
    # every access-log line (the logging docs' own optimization).
    logging._srcfile = None
    if settings.log_format == "json":
        # Access-log lines are complete JSON objects on their own line.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.propagate = False
    asyncio.run(serve(registry, settings, host, port, **kwargs))
