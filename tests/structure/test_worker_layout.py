"""The worker stays readable: the scheduler is policy only, no worker module grows
past the size where it has more than one job. Read from the files: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

WORKER = REPO / "worker"
SCHEDULER_MAX_LINES = 300
MODULE_MAX_LINES = 400


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_scheduler_is_at_most_300_lines():
    assert _lines(WORKER / "schedule" / "scheduler.py") <= SCHEDULER_MAX_LINES


def test_no_worker_module_is_over_400_lines():
    too_long = {str(p.relative_to(WORKER)): n for p in WORKER.rglob("*.py") if (n := _lines(p)) > MODULE_MAX_LINES}
    assert not too_long, f"split these by responsibility: {too_long}"


def test_no_gateway_or_shared_module_is_over_400_lines():
    root = WORKER.parent
    too_long = {
        str(p.relative_to(root)): n
        for part in ("gateway", "shared")
        for p in (root / part).rglob("*.py")
        if (n := _lines(p)) > MODULE_MAX_LINES
    }
    assert not too_long, f"split these by responsibility: {too_long}"


def test_one_runner_contract():
    """worker/model/interfaces.py:TextRunner is the runner contract: no second base class, and the
    scheduler asks the runner's supports_* flags instead of probing for methods."""
    runner = (WORKER / "model" / "runners" / "mlx_runner.py").read_text()
    assert "ABC" not in runner and "abstractmethod" not in runner
    for name in ("scheduler.py", "admission.py", "intake.py", "sequence.py", "sequence_output.py", "prefill_plan.py"):
        source = (WORKER / "schedule" / name).read_text()
        assert "hasattr(" not in source and "type: ignore" not in source, name


def test_worker_model_holds_rooms_by_job():
    """worker/model/ is folders by job (runners, adapters, memory, cache, cpu, speculation, the
    encoder, whisper, speech and image models) and only the modules every job shares at its root."""
    model = WORKER / "model"
    assert {p.name for p in model.glob("*.py")} == {"__init__.py", "interfaces.py", "model_info.py"}


def test_the_scheduling_floor_holds_schedulers_only():
    """A model runner lives in worker/model/ and an importer in worker/importers/, beside the
    others of their job: worker/schedule/ defines no runner class and imports no importer."""
    found = []
    for path in sorted((WORKER / "schedule").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Runner"):
                found.append(f"{path.name} defines {node.name}")
            if isinstance(node, ast.ImportFrom) and node.level == 2 and (node.module or "").startswith("importers"):
                found.append(f"{path.name} imports {node.module}")
    assert found == []


def test_gateway_api_holds_a_folder_per_api_family():
    api = WORKER.parent / "gateway" / "api"
    assert {p.name for p in api.glob("*.py")} == {"__init__.py"}
    families = {p.name for p in api.iterdir() if (p / "__init__.py").exists()}
    assert families == {"openai", "anthropic", "responses", "ollama", "llamacpp", "admin"}
