"""The shell blocks of the docs, and how tests/e2e/test_docs.py runs or checks each command.

A block is a fenced code block in a shell language. The line before its fence may mark it
`<!-- not-run: why -->` or `<!-- mac-only: why -->`; a marked block is not executed, but
every `mlxgw` command in it is still parsed by the real command line (so its flags and
values stay true). An unmarked block is executed by bash with these stand-ins:
- `curl` is the real curl, failing on an HTTP error, with 127.0.0.1:8000 pointed at the
  test's gateway;
- `mlxgw` runs `python -m helpers.doc_commands` (this file): the arguments are parsed
  by the real CLI, then `keys`, `usage`, `audit` and `models list` run for real; `up` and `worker`,
  which would serve forever, stop after the parse (the `--help` check, with values checked
  too); anything else must be marked;
- `make` is `make -n` (the targets exist and their recipes expand; `make test` would be the
  whole suite and `make run` would serve forever).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import click

SHELL_LANGS = {"sh", "bash", "shell", "console"}
MARK = re.compile(r"^<!--\s*(not-run|mac-only)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(`{3,})(\w*)")
SUBSTITUTION = re.compile(r"\$\([^()]*\)")
# First words an unmarked block may run: each has a stand-in above, or is harmless.
RUNNABLE = {"curl", "mlxgw", "make", "export", "openssl"}
# `mlxgw` sub-commands that run for real inside a test, and those that would serve forever.
RUN_FOR_REAL = {("keys",), ("usage",), ("audit",), ("models", "list")}
SERVES_FOREVER = {("up",), ("worker",)}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    text: str
    mark: str | None  # "not-run" or "mac-only"
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        if fence.group(2) in SHELL_LANGS:
            prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mark = MARK.match(prev)
            kind, reason = (mark.group(1), mark.group(2) or "") if mark else (None, "")
            blocks.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]), kind, reason))
        i = end + 1
    return blocks


def stray_marks(path: Path) -> list[int]:
    """Lines of marks that no shell block follows (a mark that marks nothing)."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if MARK.match(line.strip()):
            after = next((x for x in lines[i + 1 :] if x.strip()), "")
            fence = FENCE.match(after)
            if not fence or fence.group(2) not in SHELL_LANGS:
                out.append(i + 1)
    return out


def commands(block: Block) -> list[list[str]]:
    """Each simple command of a block as words: continuation lines and quotes spanning lines
    joined, comments dropped, split at `;`, `&&`, `||` and `|`, leading VAR=value left out."""
    out: list[list[str]] = []
    for line in _logical_lines(block.text):
        line = SUBSTITUTION.sub("SUBSTITUTED", line)  # $(...) is one word to its command
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for word in lexer:
            if set(word) <= set(";&|"):
                out.append(current)
                current = []
            else:
                current.append(word)
        out.append(current)
    return [c for c in (_drop_assignments(c) for c in out) if c]


def _logical_lines(text: str) -> list[str]:
    """Lines as the shell reads them: a trailing backslash or an open quote continues one."""
    lines, pending = [], ""
    for raw in text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{raw}" if pending else raw
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        lines.append(pending)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def _drop_assignments(words: list[str]) -> list[str]:
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return words[i:]


def mlxgw_args(words: list[str]) -> list[str] | None:
    """The arguments of an `mlxgw` command (also as .venv/bin/mlxgw), else None."""
    if words and Path(words[0]).name == "mlxgw":
        return words[1:]
    return None


def parse(args: list[str]) -> tuple[str, ...]:
    """Parse an mlxgw command line with the real CLI, as running it would (names, types,
    required values), without running it; the sub-command path it names."""
    from mlxgw.cli import main

    command: click.Command = main
    ctx = command.make_context("mlxgw", list(args), resilient_parsing=False)
    path: list[str] = []
    while isinstance(command, click.Group):
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args  # click 8.2+
        rest = [*protected, *ctx.args]
        if not rest:
            break
        name, sub, rest = command.resolve_command(ctx, rest)
        if sub is None:
            raise click.UsageError(f"no command {name}")
        path.append(sub.name or name or "")
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return tuple(path)


def main(argv: list[str]) -> int:
    """The `mlxgw` stand-in of an unmarked block (see the module docstring)."""
    try:
        path = parse(argv)
    except click.ClickException as e:
        print(f"doc command refused by the CLI: mlxgw {shlex.join(argv)}: {e.format_message()}", file=sys.stderr)
        return 2
    if path[:1] in SERVES_FOREVER:
        return 0
    if path in RUN_FOR_REAL or path[:1] in RUN_FOR_REAL:
        from mlxgw.cli import main as cli

        reads_gateway = path[:1] in (("usage",), ("audit",))  # the docs gateway's ledger and audit trail
        home = os.environ["DOC_GATEWAY_HOME"] if reads_gateway else os.environ["DOC_SCRATCH_HOME"]
        os.environ["MLXGW_HOME"] = home
        try:
            cli.main(argv, prog_name="mlxgw", standalone_mode=True)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    print(f"mlxgw {' '.join(path)} can neither run in a test nor serves forever: mark its block", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for a Markdown file's headings (outside code blocks)."""
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file or heading anchor does not exist."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    return broken
