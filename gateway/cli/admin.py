"""`mlxgw keys ...`, `mlxgw usage` and `mlxgw service ...`."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def keys() -> None:
    """API keys: create (printed once, stored as a hash), list, revoke."""


def _keys_path(path: Path | None) -> Path:
    from ...shared.paths import keys_file

    return path or keys_file()


@keys.command("create")
@click.argument("name")
@click.option("--rpm", type=int, default=None, help="requests per minute (per window)")
@click.option("--tpm", type=int, default=None, help="tokens per minute (prompt + completion)")
@click.option("--tpd", type=int, default=None, help="token budget per UTC day, counted by the usage ledger")
@click.option("--tpmo", type=int, default=None, help="token budget per UTC month, counted by the usage ledger")
@click.option("--aspm", type=int, default=None, help="seconds of audio transcribed per minute (per window)")
@click.option("--max-concurrent", type=int, default=None)
@click.option("--weight", type=float, default=None, help="fair share of a busy worker against other keys (default 1)")
@click.option(
    "--min-priority",
    type=int,
    default=None,
    help="most urgent priority it may ask, -100..100 (default 0: none below 0)",
)
@click.option("--models", default="", help="comma-separated model names or globs (default: all)")
@click.option("--expires", default=None, help="ISO time, e.g. 2027-01-01T00:00:00Z")
@click.option("--admin", is_flag=True, help="may manage keys and models, see usage, cancel anyone's request")
@click.option(
    "--manage-models",
    is_flag=True,
    help="may pull, create, copy and delete the models its --models patterns name (Ollama's /api/pull ...)",
)
@click.option(
    "--cache-group",
    default=None,
    help="share prefix-cache hits with the keys of this group (default: the gateway's default_cache_group, "
    "else none: the key's prompts are cached for itself only)",
)
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def create_key(
    name,
    rpm,
    tpm,
    tpd,
    tpmo,
    aspm,
    max_concurrent,
    weight,
    min_priority,
    models,
    expires,
    admin,
    manage_models,
    cache_group,
    path,
) -> None:
    from ..access.audit import record_local
    from ..access.key_admin import KeyEditError, create_key

    path = _keys_path(path)
    limits = {"rpm": rpm, "tpm": tpm, "tpd": tpd, "tpmo": tpmo, "aspm": aspm, "max_concurrent": max_concurrent}
    limits |= {"weight": weight, "min_priority": min_priority, "cache_group": cache_group}
    changes = {f: v for f, v in limits.items() if v is not None}
    if models:
        changes["models"] = models
    if expires is not None:
        changes["expires"] = expires
    if admin:
        changes["admin"] = True
    if manage_models:
        changes["manage_models"] = True
    try:
        key, _ = create_key(path, name, changes)
    except KeyEditError as e:
        record_local("keys.create", name, changes, reason=str(e))
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    record_local("keys.create", name, changes)
    click.echo(key)
    click.echo(f"key {name!r} stored as a SHA-256 hash in {path}; this is the only time it is shown", err=True)


GRANTS = ("cache_group", "latency_class")  # listed after the limits


@keys.command("list")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def list_keys(path) -> None:
    from ..access.keys import load_file

    data = load_file(_keys_path(path))
    for k in data.get("keys") or []:
        limits = ", ".join(
            f"{f}={k[f]}"
            for f in ("rpm", "tpm", "tpd", "tpmo", "aspm", "max_concurrent", "weight", "min_priority", *GRANTS)
            if k.get(f) is not None
        )
        admin = "\tadmin" if k.get("admin") else ""
        click.echo(
            f"{k['name']}\tmodels={','.join(k.get('models') or ['*'])}\t{limits or 'no limits'}\t"
            f"expires={k.get('expires', 'never')}\tcreated={k.get('created', '?')}{admin}"
        )


@keys.command("set")
@click.argument("name")
@click.argument("field")
@click.argument("value")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def set_field(name, field, value, path) -> None:
    """Change one field of a key (as PATCH /v1/keys/NAME does): VALUE is YAML, `null` clears it,
    e.g. `mlxgw keys set alice cache_group team-a`."""
    import yaml

    from ..access.audit import record_local
    from ..access.key_admin import KeyEditError, update_key

    change = {field: yaml.safe_load(value)}
    try:
        entry = update_key(_keys_path(path), name, change)
    except KeyEditError as e:
        record_local("keys.update", name, change, reason=str(e))
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    record_local("keys.update", name, change)
    click.echo(f"{name}: {field} = {entry.get(field)}")


@keys.command("revoke")
@click.argument("name")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def revoke_key(name, path) -> None:
    from ..access.audit import record_local
    from ..access.key_admin import KeyEditError, revoke_key

    try:
        revoke_key(_keys_path(path), name)
    except KeyEditError as e:
        record_local("keys.revoke", name, reason=str(e))
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    record_local("keys.revoke", name)
    click.echo(f"revoked {name!r}; a running gateway refuses it from its next request on")


@click.command()
@click.option("--since", default="7d", show_default=True, help="7d, 24h, 30m, today, month, all or an ISO date")
@click.option("--by", type=click.Choice(["key", "model", "api", "day"]), default="key", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--db", type=click.Path(path_type=Path), default=None, help="default: $MLXGW_HOME/usage.db")
def usage(since, by, fmt, db) -> None:
    """Requests and tokens per key, model, API or day, from the usage ledger (SQLite)."""
    from ...shared.paths import home
    from ..access.ledger import connect
    from ..access.usage import UsageQueryError, parse_since, render, totals

    db = db or home() / "usage.db"
    if not db.exists():
        click.echo(f"no usage recorded yet ({db} does not exist)", err=True)
        sys.exit(1)
    try:
        start = parse_since(since)
        conn = connect(db)
        try:
            rows = totals(conn, start, by)
        finally:
            conn.close()
    except UsageQueryError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(render(rows, fmt))
    if fmt == "table":
        _echo_batches(db.parent / "batches.db")


def _echo_batches(path: Path) -> None:
    """Batch jobs per key and status (their requests are in the rows above as batch:<api>)."""
    from ..batches.schema import summary_of

    rows = summary_of(path)
    if rows:
        click.echo("\nbatch jobs (all time):")
        for r in rows:
            click.echo(
                f"  {r['owner'] or '-'}\t{r['status']}\t{r['batches']} batches\t"
                f"{r['completed'] or 0} done, {r['failed'] or 0} failed of {r['total'] or 0} requests"
            )


@click.group()
def service() -> None:
    """Run mlxgw at boot: a launchd agent on macOS, a systemd unit on Linux."""


@service.command("install")
@click.option("--config", type=click.Path(path_type=Path), default=None)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--system", is_flag=True, help="Linux: a system unit (root) instead of a user unit")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="write the file here and do not start it (packaging, review)",
)
def install(config, host, port, system, output) -> None:
    from ...shared import paths
    from ..service import ServiceSpec, activate, default_program, render, target_path

    spec = ServiceSpec(
        program=default_program(config, host, port), workdir=Path.cwd(), home=paths.home(), system=system
    )
    path = output or target_path(system)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(spec))
    click.echo(f"wrote {path}")
    if output is None:
        sys.exit(activate(path, system))


@service.command("uninstall")
@click.option("--system", is_flag=True)
def uninstall(system) -> None:
    from ..service import deactivate, target_path

    path = target_path(system)
    if not path.exists():
        click.echo(f"nothing installed at {path}")
        return
    deactivate(path, system)
    path.unlink()
    click.echo(f"removed {path}")


@service.command("status")
@click.option("--system", is_flag=True)
def service_status(system) -> None:
    from ..service import status

    sys.exit(status(system))
