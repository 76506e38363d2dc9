"""`mlxgw launch CLIENT [-- ARGS]`: configure an agent client for this gateway and start it."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from . import claude, codex, openai_compat
from .core import LaunchError, Plan, ServerFacts

# client -> (plan maker, the names the client asks for by default: the alias table maps them)
CLIENTS: dict[str, tuple[Callable[[ServerFacts, list[str]], Plan], tuple[str, ...]]] = {
    "claude": (claude.plan, claude.CLIENT_NAMES),
    "codex": (codex.plan, codex.CLIENT_NAMES),
    "opencode": (openai_compat.opencode, openai_compat.CLIENT_NAMES),
    "qwen": (openai_compat.qwen, openai_compat.CLIENT_NAMES),
    "aider": (openai_compat.aider, openai_compat.CLIENT_NAMES),
    "continue": (openai_compat.continue_cli, openai_compat.CLIENT_NAMES),
    "crush": (openai_compat.crush, openai_compat.CLIENT_NAMES),
    "goose": (openai_compat.goose, openai_compat.CLIENT_NAMES),
}


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("client", type=click.Choice(sorted(CLIENTS)))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--print", "print_only", is_flag=True, help="show what would be set and written; change nothing")
@click.option("--url", default=None, help="the gateway (default: the local one, as `mlxgw ps` finds it)")
@click.option("--model", default=None, help="model or alias to use (default: what the client's own names reach)")
@click.option("--key", default=None, help="API key to send (default: $MLXGW_API_KEY, else a stored or new one)")
def launch(client: str, args: tuple[str, ...], print_only: bool, url: str | None, model: str | None, key: str | None):
    """Configure CLIENT (claude, codex, opencode, qwen, aider, continue, crush, goose) for the
    gateway and start it with ARGS: base URL, key, model, timeouts from the model's context and
    measured prefill rate, telemetry off. Config files are merged (backup and diff printed)."""
    from . import core, probe

    make_plan, client_names = CLIENTS[client]
    if args[:1] == ("--",):  # `mlxgw launch claude -- -p hi`: the separator is ours, not the client's
        args = args[1:]
    try:
        facts, note = probe.gather(url, model, key, client_names, create_key=not print_only)
        click.echo(f"# {note}", err=print_only is False)
        rc = core.run(make_plan(facts, list(args)), facts, print_only=print_only)
    except LaunchError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    sys.exit(rc)
