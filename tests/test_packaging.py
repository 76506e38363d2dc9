"""The installed package: one top-level `mlxgw` holding every module of the source tree.

The source folders stay at the repository's top level and pyproject maps them into `mlxgw.*`
one package at a time, so a new sub-folder that is not listed installs nothing: an editable
install (what `make setup` makes) still finds it, and only a real `pip install .` breaks.
The wheel built here is what `pip install .` installs.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {
    "gateway": "mlxgw/gateway",
    "worker": "mlxgw/worker",
    "shared": "mlxgw/shared",
    "bench": "mlxgw/bench",
    "config": "mlxgw/config",
    "deploy": "mlxgw/deploy",
    "mlxgw": "mlxgw",
}
# Files that are not Python but must ship (read at run time through the package).
DATA_SUFFIXES = {".yaml", ".template", ".sh", ".html", ".js", ".css", ".svg"}


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", *MAPPED], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out_dir = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out_dir), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out_dir.glob("mlxgw-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_the_wheel_has_one_top_level_package(wheel_names):
    tops = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"mlxgw"}


def test_every_source_module_and_data_file_is_in_the_wheel(wheel_names):
    missing = []
    for path in _tracked_files():
        top, _, rest = path.partition("/")
        if Path(path).suffix != ".py" and Path(path).suffix not in DATA_SUFFIXES:
            continue
        if top == "tests" or not rest:
            continue
        installed = f"{MAPPED[top]}/{rest}"
        if installed not in wheel_names:
            missing.append(f"{path} -> {installed}")
    assert not missing, "not installed by `pip install .` (add the package to pyproject):\n" + "\n".join(missing)


def test_worker_help_documents_every_flag():
    from click.testing import CliRunner

    from mlxgw.cli import main

    out = CliRunner().invoke(main, ["worker", "--help"])
    assert out.exit_code == 0
    for flag in (
        "--connect",
        "--model",
        "--model-path",
        "--entry",
        "--worker-id",
        "--heartbeat",
        "--liveness",
        "--orphan-after",
        "--rank",
    ):
        assert flag in out.output, flag
