"""Every dotted `mlxgw.<part>...` name in a source docstring names a module of the tree (and,
past the module, a name it defines): a docstring that points at a module a move left behind
sends its reader nowhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import REPO

PARTS = ("gateway", "worker", "shared", "bench")
DOTTED = re.compile(r"\bmlxgw\.(?:" + "|".join(PARTS) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _module_path(dotted: str) -> Path | None:
    path = REPO.joinpath(*dotted.split(".")[1:])
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def _defines(path: Path, name: str) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def resolves(dotted: str) -> bool:
    """The longest prefix that is a module, then (if anything is left) a name that module defines."""
    parts = dotted.split(".")
    for end in range(len(parts), 2, -1):
        path = _module_path(".".join(parts[:end]))
        if path is not None:
            return end == len(parts) or _defines(path, parts[end])
    return False


def stale_names(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node) or ""
            out += [f"{where}: {name}" for name in DOTTED.findall(doc) if not resolves(name.rstrip("."))]
    return out


def test_every_dotted_name_in_a_docstring_resolves():
    files = [p for part in PARTS for p in sorted((REPO / part).rglob("*.py"))]
    assert [s for p in files for s in stale_names(p.read_text(), str(p.relative_to(REPO)))] == []


@pytest.mark.parametrize(
    "doc",
    [
        "Run `python -m mlxgw.bench.no_such_study`.",
        "See mlxgw.gateway.observe (moved to the pipeline floor).",
        "mlxgw.shared.config.NoSuchName is gone.",
    ],
)
def test_a_stale_dotted_name_is_reported(doc):
    assert stale_names(f'"""{doc}"""\n', "planted")
    assert not stale_names(
        '"""python -m mlxgw.bench.overhead.request_path; mlxgw.shared.config.parse_registry"""\n', "ok"
    )
