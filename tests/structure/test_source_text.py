"""What the source's text points at exists: every dotted `mlxgw.<part>...` name in a docstring
names a module of the tree (and, past the module, a name it defines), since a docstring that
points at a module a move left behind sends its reader nowhere; and no comment cites the
project's own issue numbers, which say nothing to a reader of the code (an upstream project's
issue, named with its project, is a pointer and stays)."""

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


UPSTREAM = ("mlx-lm", "mlx", "mlx-vlm", "vllm", "llama.cpp", "transformers", "aiohttp", "pyzmq", "msgspec")
ISSUE = re.compile(r"([\w.-]*)[\s(#]*\bissues? #?\d+", re.I)


def issue_citations(source: str, where: str) -> list[str]:
    return [f"{where}: {m.group(0).strip()}" for m in ISSUE.finditer(source) if m.group(1).lower() not in UPSTREAM]


def test_no_source_cites_the_projects_own_issues():
    files = [p for part in PARTS for p in sorted((REPO / part).rglob("*.py"))]
    assert [c for p in files for c in issue_citations(p.read_text(), str(p.relative_to(REPO)))] == []


def test_an_issue_citation_is_reported_unless_upstream():
    assert issue_citations("# the worker keeps it (issue 42)\n", "planted")
    assert issue_citations('"""Fixed for issue #7."""\n', "planted")
    assert not issue_citations("reuses nothing (mlx-lm\nissue #980)", "ok")
