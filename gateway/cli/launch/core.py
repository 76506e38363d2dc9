"""What a launch does, client-independent: the facts about the server a client is configured
from, the plan a client module makes of them, config-file merging (the user's other settings
kept, a backup, a diff), and the exec."""

from __future__ import annotations

import datetime as dt
import difflib
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import yaml

from ....shared.atomic_file import write_atomically

# A value in ConfigEdit.updates that removes the key (e.g. Codex's env_key once keys are off).
DELETE = object()
# Idle/stream timeouts: no client waits less than its own default (5 min), and none more than
# an hour for a first token (past that a prefill is better served by a bigger machine).
MIN_IDLE_MS = 300_000
MAX_IDLE_MS = 3_600_000
# The prefill rate assumed before a worker has measured one: the shared 2-core test host read
# 14-51 tokens/s (docs/agents.md); a slow guess only makes the client wait longer for a hang.
UNMEASURED_PREFILL_TOKENS_PER_S = 10.0
DEFAULT_CONTEXT = 8192


class LaunchError(Exception):
    """A launch that cannot go on; the message says what to do."""


@dataclass(frozen=True)
class ServerFacts:
    """What every client's settings are computed from."""

    url: str  # the gateway's base URL, no trailing slash
    model: str  # the served model's name (the alias table already resolved)
    context_length: int
    prefill_tokens_per_s: float | None  # the worker's measured rate; None: not measured yet
    key: str | None  # the key the client sends; None: keys are off
    key_name: str | None = None  # for messages: never the key itself

    @property
    def token(self) -> str:
        """What goes where a client insists on a key: the key, or a placeholder when keys are off."""
        return self.key or "mlxgw-no-key"

    def idle_timeout_ms(self) -> int:
        """A stream may be silent for a whole-context prefill at the measured rate, with room to
        spare (x1.5 plus two minutes for a model load), within [5 min, 1 h]."""
        rate = self.prefill_tokens_per_s or UNMEASURED_PREFILL_TOKENS_PER_S
        seconds = self.context_length / rate * 1.5 + 120
        return int(min(MAX_IDLE_MS, max(MIN_IDLE_MS, math.ceil(seconds) * 1000)))

    def request_timeout_ms(self) -> int:
        """A whole request: the prefill bound plus the gateway's default answer time (300 s) and margin."""
        return self.idle_timeout_ms() + 600_000

    def max_output_tokens(self) -> int:
        """A quarter of the context: a client that asks for more leaves no room for its prompt."""
        return max(256, self.context_length // 4)


@dataclass
class ConfigEdit:
    """Keys to set in a client's config file, merged into what is there (replace: the whole
    file is mlxgw's own, written as given)."""

    path: Path
    fmt: Literal["json", "toml", "yaml"]
    updates: Any
    replace: bool = False


@dataclass
class Plan:
    client: str
    binary: str  # the command looked up on PATH
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)  # variables that would send a foreign key here
    edits: list[ConfigEdit] = field(default_factory=list)
    install: str = ""  # the command that installs the client
    notes: list[str] = field(default_factory=list)


# -- config files ---------------------------------------------------------------------------------
def _merge(base: Any, updates: Any) -> Any:
    """Deep merge for mappings (JSON dicts and tomlkit tables alike); leaves replace."""
    if not isinstance(updates, dict) or not hasattr(base, "keys"):
        return updates
    for key, value in updates.items():
        if value is DELETE:
            if key in base:
                del base[key]
        elif isinstance(value, dict) and key in base and hasattr(base[key], "keys"):
            base[key] = _merge(base[key], value)
        else:
            base[key] = _strip_deletes(value)
    return base


def _strip_deletes(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_deletes(v) for k, v in value.items() if v is not DELETE}
    return value


def _parse(text: str, fmt: str, path: Path) -> Any:
    try:
        if fmt == "json":
            return json.loads(text) if text.strip() else {}
        if fmt == "toml":
            import tomlkit

            return tomlkit.parse(text)
        return yaml.safe_load(text) or {}
    except Exception as e:  # each parser has its own error type; all mean the same here
        raise LaunchError(f"{path} is not valid {fmt.upper()} ({e}); fix or move it, then launch again") from None


def _render(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    if fmt == "toml":
        import tomlkit

        return tomlkit.dumps(data)
    return yaml.safe_dump(data, sort_keys=False)


def planned_text(edit: ConfigEdit) -> tuple[str, str]:
    """The file's text now ("" when absent) and after the edit."""
    old = edit.path.read_text() if edit.path.exists() else ""
    if edit.replace:
        return old, _render(edit.updates, edit.fmt)
    merged = _merge(_parse(old, edit.fmt, edit.path), edit.updates)
    if not hasattr(merged, "keys"):
        raise LaunchError(f"{edit.path} does not hold a {edit.fmt.upper()} object; fix or move it")
    return old, _render(merged, edit.fmt)


def diff(path: Path, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (before)", f"{path} (after)")
    )


def backup_path(path: Path) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return path.with_name(f"{path.name}.bak-{stamp}")


def write_edit(edit: ConfigEdit, old: str, new: str) -> Path | None:
    """Write the new text (owner-only, it may name a key variable); the old file is kept
    next to it first. A config that is a symlink (a dotfiles repository's) is written through
    to its target, atomically there, and stays a link. Returns the backup's path (None when
    there was no file)."""
    target = edit.path.resolve() if edit.path.is_symlink() else edit.path
    target.parent.mkdir(parents=True, exist_ok=True)
    backup = None
    if target.exists():
        backup = backup_path(edit.path)
        shutil.copy2(target, backup)
    write_atomically(target, new)
    return backup


# -- running --------------------------------------------------------------------------------------
def _masked(text: str, facts: ServerFacts) -> str:
    return text.replace(facts.key, f"<key {facts.key_name or 'given'}>") if facts.key else text


def describe(plan: Plan, facts: ServerFacts, out: TextIO) -> None:
    """The plan as shell lines (the key itself never printed)."""
    keys = f"key {facts.key_name!r}" if facts.key else "keys off"
    rate = f"{facts.prefill_tokens_per_s:.0f} tokens/s measured" if facts.prefill_tokens_per_s else "not measured"
    out.write(f"# mlxgw launch {plan.client}: {facts.url}, model {facts.model}, {keys}\n")
    out.write(f"# context {facts.context_length} tokens, prefill {rate}\n")
    for name in plan.unset:
        out.write(f"unset {name}\n")
    for name, value in plan.env.items():
        out.write(_masked(f"export {name}={shlex.quote(value)}\n", facts))
    for note in plan.notes:
        out.write(f"# {note}\n")
    out.write(_masked(f"# exec: {shlex.join([plan.binary, *plan.args])}\n", facts))


def run(
    plan: Plan,
    facts: ServerFacts,
    *,
    print_only: bool,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    exec_fn: Callable[[str, list[str], dict[str, str]], None] = os.execvpe,
) -> int:
    """Print (--print) or write the config edits, then exec the client."""
    describe(plan, facts, out)
    pending = []
    for edit in plan.edits:
        old, new = planned_text(edit)
        if old == new:
            out.write(f"# {edit.path}: already set\n")
            continue
        out.write(f"# {'would write' if print_only else 'writing'} {edit.path}:\n")
        for line in diff(edit.path, old, new).splitlines():
            out.write(f"#   {_masked(line, facts)}\n")
        pending.append((edit, old, new))
    if print_only:
        return 0
    binary = shutil.which(plan.binary)
    if binary is None:
        err.write(f"error: {plan.binary} is not installed (not on PATH); install it with:\n  {plan.install}\n")
        return 127
    for edit, old, new in pending:
        backup = write_edit(edit, old, new)
        if backup is not None:
            err.write(f"mlxgw: {edit.path} updated; the previous file is {backup}\n")
    env = {k: v for k, v in os.environ.items() if k not in plan.unset}
    env.update(plan.env)
    out.flush()
    err.flush()
    exec_fn(binary, [binary, *plan.args], env)
    return 0  # only reached when exec_fn is not a real exec
