"""The layering the architecture states, read from the source with `ast` (nothing imported):
the gateway imports no worker code and no MLX, `shared/` imports neither the gateway nor the
worker, the worker imports no gateway code, and no modules import each other in a cycle,
counting lazy imports inside functions too (only `if TYPE_CHECKING:` blocks, which never
run, are left out)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO
PARTS = ("gateway", "worker", "shared", "bench")
MLX_PACKAGES = ("mlx", "mlx_lm", "mlx_vlm", "mlx_embeddings", "mlx_whisper", "mlx_audio")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["mlxgw", *parts])


MODULES: dict[str, Path] = {_module_name(p): p for part in PARTS for p in sorted((ROOT / part).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every import that can run: module level, in functions and in branches."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _import_nodes_of(child))
            continue
        yield from _import_nodes_of(node)


def _import_nodes_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _import_nodes(node)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, source: str | None = None, is_package: bool | None = None) -> set[str]:
    """The modules (ours and third-party, by full name) that `module` imports; `source` reads
    planted code instead of the file, so the rules below can be shown to fail."""
    path = MODULES.get(module)
    if source is None:
        source = path.read_text()
    if is_package is None:
        is_package = path is not None and path.name == "__init__.py"
    tree = ast.parse(source, str(path or module))
    out: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        target = _resolve(module, is_package, node)
        for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub
            sub = f"{target}.{alias.name}"
            out.add(sub if sub in MODULES else target)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def _part(module: str) -> str:
    return module.split(".")[1] if module.startswith("mlxgw.") and module.count(".") else ""


def _offenders(part: str, forbidden, graph: dict[str, set[str]] | None = None) -> list[str]:
    graph = GRAPH if graph is None else graph
    return sorted(f"{m} imports {i}" for m in graph if _part(m) == part for i in graph[m] if forbidden(i))


def _is_bare(name: str) -> bool:
    """`import shared.paths` from the repository root loads a second copy of the module beside
    `mlxgw.shared.paths` and breaks in a wheel, where only the `mlxgw` package exists."""
    return name.split(".")[0] in PARTS


def _is_mlx(name: str) -> bool:
    return name.split(".")[0] in MLX_PACKAGES


def test_the_graph_sees_the_whole_tree():
    assert len(MODULES) > 150 and "mlxgw.gateway.app" in MODULES and "mlxgw.worker.schedule.scheduler" in MODULES
    assert "mlxgw.shared.protocol" in GRAPH["mlxgw.gateway.link.broker"]  # an absolute import is seen
    assert "mlxgw.gateway.web.routes" in GRAPH["mlxgw.gateway.access.auth"]  # a relative one too


RULES = {
    "gateway": lambda i: i.startswith(("mlxgw.worker", "worker.")) or _is_mlx(i),
    "shared": lambda i: i.startswith(("mlxgw.gateway", "mlxgw.worker", "gateway.", "worker.")),
    "worker": lambda i: i.startswith(("mlxgw.gateway", "gateway.")),
}


def test_the_gateway_imports_no_worker_and_no_mlx():
    assert _offenders("gateway", RULES["gateway"]) == []


def test_shared_imports_neither_the_gateway_nor_the_worker():
    assert _offenders("shared", RULES["shared"]) == []


def test_the_worker_imports_no_gateway():
    assert _offenders("worker", RULES["worker"]) == []


def test_no_module_imports_a_top_folder_by_its_bare_name():
    assert [o for part in PARTS for o in _offenders(part, _is_bare)] == []


PLANTED = {
    "gateway": [
        "from mlxgw.worker import engine",
        "from worker import engine",
        "import mlx.core as mx",
        "from ..worker import engine",
    ],
    "shared": ["import gateway.state", "from mlxgw.gateway import state", "from ..worker.engine import run"],
    "worker": ["from gateway.api import errors", "from mlxgw.gateway import broker"],
}


@pytest.mark.parametrize("part,line", [(p, line) for p, lines in PLANTED.items() for line in lines])
def test_each_rule_fails_on_a_planted_violation(part, line):
    """The rules run on real edits: each planted import, placed in a real module of that part,
    is reported (by the floor rule or, for a bare name, the bare-import rule)."""
    module = next(m for m in MODULES if _part(m) == part and m.count(".") == 2 and MODULES[m].name != "__init__.py")
    planted = {module: imports_of(module, MODULES[module].read_text() + "\n" + line + "\n")}
    found = _offenders(part, RULES[part], planted) + _offenders(part, _is_bare, planted)
    assert found, f"{line!r} in {module} was not reported"


# The floors of each part, top to bottom: a module imports its own floor and the floors below
# it, never one above (imports inside `if TYPE_CHECKING:` never run and are not counted). A
# part's root modules (the gateway's entry points and its cli/ and console/ folders, the
# worker's __main__) sit above every floor.
FLOORS = {
    "gateway": ("api", "mcp", "batches", "pipeline", "access", "models", "link", "web"),
    "worker": ("process", "schedule", "importers", "model", "text"),
}


def floor_of(module: str) -> int | None:
    """The rank of a module's floor in its part (0 = the top), or None outside the floored parts
    and for the part's package itself (`import mlxgw.gateway` names no floor)."""
    parts = module.split(".")
    floors = FLOORS.get(_part(module))
    if floors is None or len(parts) < 3:
        return None
    return floors.index(parts[2]) + 1 if parts[2] in floors else 0


def upward_imports(graph: dict[str, set[str]] | None = None) -> list[str]:
    graph = GRAPH if graph is None else graph
    out = []
    for module, deps in graph.items():
        mine = floor_of(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = floor_of(dep)
            if theirs is not None and _part(dep) == _part(module) and theirs < mine:
                out.append(f"{module} imports {dep}, a floor above it")
    return sorted(out)


def test_every_folder_of_a_floored_part_is_a_known_floor():
    for part, floors in FLOORS.items():
        folders = {p.name for p in (ROOT / part).iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        assert folders - {"cli", "console"} == set(floors), part


def test_imports_run_only_down_the_floors():
    assert upward_imports() == []


PLANTED_UPWARD = [
    ("mlxgw.worker.text.templates", "from mlxgw.worker.model import runner"),
    ("mlxgw.worker.model.runners.sampling", "from mlxgw.worker.schedule.sequence import Sequence"),
    ("mlxgw.worker.model.cache.prefix_cache", "from ...process import engine"),
    ("mlxgw.worker.schedule.scheduler", "import mlxgw.worker.process.main"),
    ("mlxgw.gateway.web.routes", "from mlxgw.gateway.pipeline import translate"),
    ("mlxgw.gateway.link.broker", "from ..models.manager import ModelManager"),
    ("mlxgw.gateway.pipeline.body", "from mlxgw.gateway.api import openai_chat"),
    ("mlxgw.gateway.models.manager", "from mlxgw.gateway import app"),
]


@pytest.mark.parametrize("module,line", PLANTED_UPWARD)
def test_an_import_up_a_floor_is_reported(module, line):
    """The floor rule runs on a real module with one planted import, inside a function too."""
    for source in (line, "def planted():\n    " + line):
        planted = {module: imports_of(module, MODULES[module].read_text() + "\n" + source + "\n")}
        assert upward_imports(planted), f"{line!r} in {module} was not reported"


# gateway/api/ holds one folder per API family; a family builds on pipeline/ and below, never
# on another family (what two families share belongs on a floor below them).
FAMILIES = ("openai", "anthropic", "responses", "ollama", "llamacpp", "admin")


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[3] if parts[:3] == ["mlxgw", "gateway", "api"] and len(parts) > 3 else None


def cross_family_imports(graph: dict[str, set[str]] | None = None) -> list[str]:
    graph = GRAPH if graph is None else graph
    return sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if _family(m)
        for d in deps
        if _family(d) not in (None, _family(m))
    )


def test_an_api_family_imports_no_other_family():
    assert cross_family_imports() == []


@pytest.mark.parametrize(
    "module,line",
    [
        ("mlxgw.gateway.api.llamacpp.tokenize", "from ..openai.chat import parse"),
        ("mlxgw.gateway.api.openai.chat", "from mlxgw.gateway.api.responses import output"),
        ("mlxgw.gateway.api.responses.responses", "import mlxgw.gateway.api.ollama.common"),
    ],
)
def test_an_import_of_another_family_is_reported(module, line):
    for source in (line, "def planted():\n    " + line):
        planted = {module: imports_of(module, MODULES[module].read_text() + "\n" + source + "\n")}
        assert cross_family_imports(planted), f"{line!r} in {module} was not reported"


def test_an_import_up_a_floor_for_type_checking_only_is_allowed():
    module = "mlxgw.gateway.web.state"
    planted = {
        module: imports_of(
            module,
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from mlxgw.gateway.models.manager import ModelManager\n",
        )
    }
    assert upward_imports(planted) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root] & graph.keys())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child] & graph.keys()))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("part", PARTS)
def test_no_import_cycles(part):
    inside = {m: {i for i in deps if _part(i) == part} for m, deps in GRAPH.items() if _part(m) == part}
    assert cycles(inside) == []


def test_no_import_cycles_across_parts():
    assert cycles(GRAPH) == []


@functools.cache
def _top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (the names `from it import x` finds)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def unresolved_imports(sources: dict[str, str] | None = None) -> list[str]:
    """Imports of our own modules that name nothing of the tree: an import inside a function
    runs only when called, so a path a move left behind fails late, in a user's request (one
    did: a disk-tier read skipped every block on disk after the floors moved)."""
    out = []
    for module, path in MODULES.items():
        source = (sources or {}).get(module)
        if sources is not None and source is None:
            continue
        tree = ast.parse(source if source is not None else path.read_text())
        is_package = path.name == "__init__.py"
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                out += [
                    f"{module} imports {a.name}" for a in node.names if _part(a.name) in PARTS and a.name not in MODULES
                ]
                continue
            target = _resolve(module, is_package, node)
            if _part(target) not in PARTS:
                continue
            if target not in MODULES:
                out.append(f"{module} imports {target}")
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub not in MODULES and alias.name not in _top_level_names(MODULES[target]):
                    out.append(f"{module} imports {sub}")
    return sorted(out)


def test_every_import_of_our_own_names_a_module_or_name_that_exists():
    assert unresolved_imports() == []


@pytest.mark.parametrize(
    "line",
    [
        "from mlxgw.worker import quantized_kv",
        "from mlxgw.worker.model.cache.kv_blocks import NoSuchThing",
        "import mlxgw.worker.prefix_cache",
        "from ..quantized_kv import QuantizedKV",
    ],
)
def test_an_import_a_move_left_behind_is_reported(line):
    module = "mlxgw.worker.model.cache.block_disk"
    planted = MODULES[module].read_text() + "\ndef read():\n    " + line + "\n"
    assert unresolved_imports({module: planted}), line
