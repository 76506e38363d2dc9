"""The gateway's commands of `mlxgw` (up, reload, status). This package never imports worker code."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ...shared.cli_table import print_table
from ...shared.config import ConfigError, load_registry, with_discovered_models
from ...shared.resources import default_config
from .config_flags import gateway_flags, with_flags


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="models.yaml (default: config/models.yaml); its gateway: section sets what the flags below override",
)
@gateway_flags
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
@click.option(
    "--echo",
    "echo_model",
    is_flag=True,
    default=False,
    help="also serve `echo`, a model that repeats the last message instantly (tool calls too): for trying clients",
)
def up(
    config_path: Path | None,
    worker_listen: tuple[str, ...],
    keys_path: Path | None,
    metrics_token: str | None,
    echo_model: bool,
    **flags,
) -> None:
    """Start the gateway and the workers of the models in the registry."""
    import os

    from ...shared.paths import keys_file
    from ..server import run
    from ..web.state import GatewaySettings

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
    if echo_model:
        registry = with_echo_model(registry)
    gw = with_flags(registry.gateway, flags)
    if gw.oidc_issuer and keys_path is None:  # people and their keys live beside the keys
        click.echo("error: sign-in (oidc_issuer) needs API keys: start with --keys FILE", err=True)
        sys.exit(2)
    if gw.host not in ("127.0.0.1", "localhost", "::1") and keys_path is None:
        click.echo(f"warning: listening on {gw.host} without API keys: anyone who can reach it can use it", err=True)
    settings = GatewaySettings.from_config(gw, keys_path=keys_path, metrics_token=metrics_token)
    run(registry, settings, gw.host, gw.port, config_path=config_path, extra_endpoints=worker_listen, secret=secret)


ECHO_MODEL = "echo"


def with_echo_model(registry):
    """The registry plus the echo engine under the name `echo` (no weights, no load time):
    point a client at model `echo` to try its requests, tool loops included."""
    import dataclasses

    from ...shared.model_sections import ModelEntry

    if any(m.name == ECHO_MODEL for m in registry.models):
        return registry
    echo = ModelEntry(name=ECHO_MODEL, engine="echo", preload=True)
    return dataclasses.replace(registry, models=[*registry.models, echo])


@click.command()
@click.option("--port", default=8000, show_default=True, type=int, help="the gateway's HTTP port")
def reload(port: int) -> None:
    """Re-read models.yaml in a running gateway (same as sending it SIGHUP)."""
    import os
    import signal

    from ..runfiles import find_gateway

    pid, note = find_gateway(port)
    if pid is None:
        click.echo(f"error: no mlxgw gateway is running on port {port}{note}", err=True)
        sys.exit(2)
    os.kill(pid, signal.SIGHUP)
    click.echo(f"asked gateway {pid} to reload its registry{note}")


def _state_text(model: dict) -> str:
    """The state column; a loading model with how far its load has got ("loading 312/540 MB")."""
    load = model.get("load")
    if model["state"] != "loading" or not isinstance(load, dict):
        return model["state"]
    return f"loading {load['loaded_bytes'] / 1e6:.0f}/{load['expected_bytes'] / 1e6:.0f} MB"


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
                _state_text(m),
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
