"""`mlxgw keys ...` and `mlxgw service ...`."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import click


@click.group()
def keys() -> None:
    """API keys: create (printed once, stored as a hash), list, revoke."""


def _keys_path(path: Path | None) -> Path:
    from mlxgw.shared.paths import keys_file

    return path or keys_file()


@keys.command("create")
@click.argument("name")
@click.option("--rpm", type=int, default=None, help="requests per minute (per window)")
@click.option("--tpm", type=int, default=None, help="tokens per minute (prompt + completion)")
@click.option("--max-concurrent", type=int, default=None)
@click.option("--models", default="", help="comma-separated model names or globs (default: all)")
@click.option("--expires", default=None, help="ISO time, e.g. 2027-01-01T00:00:00Z")
@click.option("--admin", is_flag=True, help="may cancel anyone's request and clear prefix caches")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def create_key(name, rpm, tpm, max_concurrent, models, expires, admin, path) -> None:
    from mlxgw.gateway.keys import KeysFileError, hash_key, load_file, new_key, save_file

    path = _keys_path(path)
    try:
        data = load_file(path)
    except KeysFileError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if any(k.get("name") == name for k in data.get("keys") or []):
        click.echo(f"error: a key named {name!r} exists; revoke it first", err=True)
        sys.exit(2)
    key = new_key()
    entry = {
        "name": name,
        "sha256": hash_key(key),
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    for field, value in (("rpm", rpm), ("tpm", tpm), ("max_concurrent", max_concurrent), ("expires", expires)):
        if value is not None:
            entry[field] = value
    if models:
        entry["models"] = [m.strip() for m in models.split(",") if m.strip()]
    if admin:
        entry["admin"] = True
    data.setdefault("keys", []).append(entry)
    try:
        from mlxgw.gateway.keys import parse_keys

        parse_keys(data, str(path))
    except KeysFileError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    save_file(path, data)
    click.echo(key)
    click.echo(f"key {name!r} stored as a SHA-256 hash in {path}; this is the only time it is shown", err=True)


@keys.command("list")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def list_keys(path) -> None:
    from mlxgw.gateway.keys import load_file

    data = load_file(_keys_path(path))
    for k in data.get("keys") or []:
        limits = ", ".join(f"{f}={k[f]}" for f in ("rpm", "tpm", "max_concurrent") if k.get(f) is not None)
        admin = "\tadmin" if k.get("admin") else ""
        click.echo(
            f"{k['name']}\tmodels={','.join(k.get('models') or ['*'])}\t{limits or 'no limits'}\t"
            f"expires={k.get('expires', 'never')}\tcreated={k.get('created', '?')}{admin}"
        )


@keys.command("revoke")
@click.argument("name")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None)
def revoke_key(name, path) -> None:
    from mlxgw.gateway.keys import load_file, save_file

    path = _keys_path(path)
    data = load_file(path)
    before = len(data.get("keys") or [])
    data["keys"] = [k for k in data.get("keys") or [] if k.get("name") != name]
    if len(data["keys"]) == before:
        click.echo(f"error: no key named {name!r}", err=True)
        sys.exit(2)
    save_file(path, data)
    click.echo(f"revoked {name!r}; a running gateway picks this up on its next request")


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
    from mlxgw.gateway.service import ServiceSpec, activate, default_program, render, target_path
    from mlxgw.shared import paths

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
    from mlxgw.gateway.service import deactivate, target_path

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
    from mlxgw.gateway.service import status

    sys.exit(status(system))
