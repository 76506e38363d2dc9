"""Plain aligned tables for the command line (`mlxgw ps`, `mlxgw models list`)."""

from __future__ import annotations

import click


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
