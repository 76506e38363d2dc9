"""Every import between the package's modules is relative and names a real file of the tree
itself, so a reader that does not follow mlxgw/'s links (a structure drawing tool, an
editor's indexer, `grep` on the real folders) sees the same graph Python does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO

PARTS = ("gateway", "worker", "shared", "bench")


def problems(path: Path, source: str | None = None) -> list[str]:
    """The imports of one file that are absolute into the package, or whose relative target is
    no file or folder beside it in the real tree."""
    tree = ast.parse(path.read_text() if source is None else source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "mlxgw"]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").split(".")[0] == "mlxgw":
                    out.append(f"from {node.module} import ...")
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split(".")) if node.module else base
            names = [target / a.name for a in node.names] if not node.module else [target]
            for t in names:
                if not (t.with_suffix(".py").is_file() or (t / "__init__.py").is_file()) and node.module:
                    out.append(f"from {'.' * node.level}{node.module} import ... (no {t.relative_to(REPO)})")
    return out


FILES = [p for part in PARTS for p in sorted((REPO / part).rglob("*.py"))]


def test_the_files_are_found():
    assert len(FILES) > 200


@pytest.mark.parametrize("part", PARTS)
def test_every_import_inside_the_package_is_relative_and_resolves_in_the_tree(part):
    bad = {str(p.relative_to(REPO)): problems(p) for p in FILES if p.relative_to(REPO).parts[0] == part}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize(
    "planted",
    ["from mlxgw.shared import protocol", "import mlxgw.shared.protocol", "from ...shared.no_such_module import x"],
)
def test_a_planted_absolute_or_dangling_import_is_found(planted):
    assert problems(REPO / "gateway" / "api" / "openai_chat.py", planted)
