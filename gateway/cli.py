"""The gateway's commands of `mlxgw` (up, reload, status). This package never imports worker code."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from mlxgw.shared.cli_table import print_table
from mlxgw.shared.config import ConfigError, load_registry, with_discovered_models
from mlxgw.shared.resources import default_config


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="models.yaml (default: config/models.yaml)",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--timeout", default=None, type=float, help="request timeout in seconds (default 300)")
@click.option(
    "--worker-listen",
    multiple=True,
    help="also accept remote workers here, e.g. tcp://0.0.0.0:5555 (needs MLXGW_SECRET)",
)
@click.option(
    "--keys",
    "keys_path",
    type=click.Path(path_type=Path),
    default=None,
    help="API keys file (default: $MLXGW_HOME/keys.yaml when it exists; none: open)",
)
@click.option("--metrics-token", envvar="MLXGW_METRICS_TOKEN", default=None, help="bearer token for /metrics")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--log-prompts", is_flag=True, help="include prompts in the access log (off by default)")
@click.option("--cors-origins", default="", help="comma-separated origins allowed by CORS (default: none)")
@click.option("--max-tokens-cap", type=int, default=None, help="server-wide ceiling on max_tokens")
@click.option(
    "--max-tokens-default",
    type=int,
    default=None,
    help="max_tokens when neither the request nor the model entry sets one (default: the context)",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1),
    default=1024,
    show_default=True,
    help="open connections and concurrent requests (kept below the file-descriptor limit)",
)
@click.option("--header-timeout", type=click.FloatRange(0.1), default=10.0, show_default=True, help="seconds")
@click.option("--idle-timeout", type=click.FloatRange(0.1), default=30.0, show_default=True, help="seconds")
@click.option("--body-timeout", type=click.FloatRange(0.1), default=60.0, show_default=True, help="seconds")
@click.option(
    "--allow-image-urls",
    is_flag=True,
    help="fetch http(s) image URLs for vision models (public addresses only; default: data: URLs only)",
)
@click.option("--max-image-mb", type=float, default=8, show_default=True, help="largest accepted image")
def up(
    config_path: Path | None,
    host: str,
    port: int,
    timeout: float | None,
    worker_listen: tuple[str, ...],
    keys_path: Path | None,
    metrics_token: str | None,
    log_format: str,
    log_prompts: bool,
    cors_origins: str,
    max_tokens_cap: int | None,
    max_tokens_default: int | None,
    max_connections: int,
    header_timeout: float,
    idle_timeout: float,
    body_timeout: float,
    allow_image_urls: bool,
    max_image_mb: float,
) -> None:
    """Start the gateway and the workers of the models in the registry."""
    import os

    from mlxgw.gateway.api.images import ImageLimits
    from mlxgw.gateway.server import run
    from mlxgw.gateway.state import GatewaySettings
    from mlxgw.shared.paths import keys_file

    config_path = config_path or default_config()
    try:
        registry = with_discovered_models(load_registry(config_path))
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    secret = os.environ.get("MLXGW_SECRET", "")
    if any(not e.startswith("ipc://") for e in worker_listen) and len(secret) < 16:
        click.echo(
            "error: --worker-listen on a network endpoint needs MLXGW_SECRET (16+ characters) "
            "shared with the remote workers",
            err=True,
        )
        sys.exit(2)
    if keys_path is None and keys_file().exists():
        keys_path = keys_file()
    if keys_path is not None and not keys_path.exists():
        click.echo(f"error: keys file {keys_path} does not exist (create keys with `mlxgw keys create`)", err=True)
        sys.exit(2)
    if host not in ("127.0.0.1", "localhost", "::1") and keys_path is None:
        click.echo(f"warning: listening on {host} without API keys: anyone who can reach it can use it", err=True)
    m = registry.manager
    settings = GatewaySettings(
        request_timeout_s=timeout or m.request_timeout_seconds,
        max_body_bytes=m.max_body_bytes,
        keys_path=keys_path,
        metrics_token=metrics_token,
        log_format=log_format,
        log_prompts=log_prompts,
        cors_origins=tuple(o.strip() for o in cors_origins.split(",") if o.strip()),
        max_tokens_cap=max_tokens_cap,
        max_tokens_default=max_tokens_default,
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        idle_timeout_s=idle_timeout,
        body_timeout_s=body_timeout,
        images=ImageLimits(max_bytes=int(max_image_mb * (1 << 20)), allow_urls=allow_image_urls),
    )
    run(registry, settings, host, port, config_path=config_path, extra_endpoints=worker_listen, secret=secret)


@click.command()
@click.option("--port", default=8000, show_default=True, type=int, help="the gateway's HTTP port")
def reload(port: int) -> None:
    """Re-read models.yaml in a running gateway (same as sending it SIGHUP)."""
    import os
    import signal

    from mlxgw.gateway.server import pid_file

    try:
        pid = int(pid_file(port).read_text())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError):
        click.echo(f"error: no gateway running on port {port} (no pid file at {pid_file(port)})", err=True)
        sys.exit(2)
    click.echo(f"asked gateway {pid} to reload its registry")


@click.command(name="status")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
def status_cmd(url: str) -> None:
    """Models, their state, memory, requests and speed (also: mlxgw ps)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/status", timeout=10) as r:
            status = json.load(r)
    except OSError as e:
        click.echo(f"error: cannot reach {url}: {e}", err=True)
        sys.exit(2)
    rows = [("MODEL", "STATE", "WORKERS", "MEMORY", "RUNNING", "WAITING", "TOK/S", "IDLE", "LAST ERROR")]
    for m in status["models"]:
        stats = [w.get("stats") or {} for w in m["workers"]]
        rows.append(
            (
                m["name"],
                m["state"],
                str(len(m["workers"])),
                f"{m['memory_bytes'] / 1e6:.0f} MB" if m["memory_bytes"] else "-",
                str(sum(s.get("running", 0) for s in stats)),
                str(sum(s.get("waiting", 0) for s in stats)),
                f"{sum(s.get('tokens_per_s', 0) for s in stats):.1f}",
                f"{m['idle_s']:.0f} s",
                (m["last_error"] or "")[:60],
            )
        )
    print_table(rows)
    mem = status.get("memory") or {}
    if mem:
        click.echo(
            f"memory: {mem['used_bytes'] / 1e6:.0f} of {mem['budget_bytes'] / 1e6:.0f} MB budget; "
            f"evictions {mem['evictions']}, idle unloads {mem['idle_unloads']}"
        )
