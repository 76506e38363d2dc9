"""`mlxgw audit`: the audit trail ($MLXGW_HOME/audit.jsonl), listed with filters or exported
as JSON lines, and `mlxgw audit verify`: the first entry edited, deleted or reordered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


def _file(path: Path | None):
    from ..access.audit import audit_path
    from ..access.audit.store import AuditFile

    return AuditFile(path or audit_path())


def _who(actor: dict) -> str:
    if actor.get("kind") == "key":
        return f"{actor.get('name')}({actor.get('id')})"
    if actor.get("kind") == "cli":
        return f"cli:{actor.get('user')}" + (f"/{actor['via']}" if actor.get("via") else "")
    return f"{actor.get('kind')}:{actor.get('address') or actor.get('signal') or '-'}"


@click.group(invoke_without_command=True)
@click.option("--since", default=None, help="7d, 24h, 30m, today, month, all or an ISO date (default: all)")
@click.option("--actor", default=None, help="a key's name or id, cli, or an OS user")
@click.option("--action", default=None, help='an action, or a prefix ending in "." (keys.)')
@click.option("--target", default=None)
@click.option("--outcome", type=click.Choice(["ok", "refused", "failed", "cancelled"]), default=None)
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True, help="the newest N that match")
@click.option("--jsonl", is_flag=True, help="one JSON object a line (export)")
@click.option("--file", "path", type=click.Path(path_type=Path), default=None, help="default: $MLXGW_HOME/audit.jsonl")
@click.pass_context
def audit(ctx, since, actor, action, target, outcome, limit, jsonl, path) -> None:
    """Who changed what: keys, models, adapters, caches, reloads (admins' and model managers')."""
    ctx.obj = path
    if ctx.invoked_subcommand is not None:
        return
    from ..access.audit.store import matches
    from ..access.usage import UsageQueryError, parse_since

    try:
        start = parse_since(since) if since else None
    except UsageQueryError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    wanted = {"actor": actor, "action": action, "target": target, "outcome": outcome}
    found = [e for e in _file(path).entries() if matches(e, start, **wanted)][-limit:]
    for e in found:
        if jsonl:
            click.echo(json.dumps(e, separators=(",", ":")))
            continue
        status = f" {e['status']}" if e.get("status") else ""
        why = f": {e['reason']}" if e.get("reason") else ""
        change = json.dumps(e.get("change") or {}, separators=(",", ":"))
        click.echo(
            f"{e['seq']}\t{e['time']}\t{_who(e.get('actor') or {})}\t{e['action']}\t{e.get('target') or '-'}\t"
            f"{e['outcome']}{status}{why}\t{change}"
        )


@audit.command("verify")
@click.pass_obj
def verify(path) -> None:
    """Check the hash chain; exit 1 and name the first entry edited, deleted or reordered."""
    audit_file = _file(path)
    result = audit_file.verify()
    anchor = result.get("anchor")
    kept = f" (after {anchor['dropped']} dropped by retention)" if anchor else ""
    if result["ok"]:
        click.echo(f"ok: {result['entries']} entries in {audit_file.path} chain unbroken{kept}")
        return
    bad = result["first_bad"]
    line = f"line {bad['line']}, " if bad.get("line") else ""
    click.echo(f"BROKEN at {line}entry {bad['seq']}: {bad['problem']}", err=True)
    sys.exit(1)
