"""The installed package: one top-level `mlxgw` holding every module of the source tree.

The source folders stay at the repository's top level and mlxgw/<part> are symlinks to them,
which package discovery follows: a new sub-folder installs with no pyproject edit. The wheel
built here is what `pip install .` installs; the layout tests below check that every install
mode resolves all of `mlxgw.*` from one tree (no half-checkout, half-install imports).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO
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
DATA_SUFFIXES = {".yaml", ".template", ".sh", ".json", ".html", ".js", ".css", ".svg"}


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", *MAPPED], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out_dir), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (path,) = out_dir.glob("mlxgw-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
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
    assert not missing, "not installed by `pip install .`:\n" + "\n".join(missing)


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


# Modules from each layer; the worker's package itself (not its MLX modules) keeps this fast.
_PROBE = (
    "import os, mlxgw, mlxgw.cli, mlxgw.gateway.api, mlxgw.shared.protocol, mlxgw.worker, mlxgw.bench, mlxgw.config;"
    "mods = [mlxgw, mlxgw.cli, mlxgw.gateway.api, mlxgw.shared.protocol, mlxgw.worker, mlxgw.bench, mlxgw.config];"
    "print('\\n'.join(os.path.realpath(m.__file__) for m in mods))"
)


def _imported_from(cwd: Path, pythonpath: str | None) -> set[Path]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return {Path(line) for line in out.stdout.split()}


def _all_under(paths: set[Path], root: Path) -> bool:
    root = root.resolve()
    return all(path.is_relative_to(root) for path in paths)


def test_from_the_checkout_every_module_is_the_checkouts(tmp_path):
    """Run from the repository root, whatever is installed: the checkout, all of it."""
    assert _all_under(_imported_from(ROOT, None), ROOT)


def test_the_tests_children_import_this_checkout_from_any_folder(tmp_path):
    """conftest puts the checkout on PYTHONPATH, so gateways, workers and CLIs that tests start
    run this checkout's code even where an editable install points at another checkout."""
    assert os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] == str(ROOT)
    assert _all_under(_imported_from(tmp_path, os.environ["PYTHONPATH"]), ROOT)


def test_a_regular_install_is_one_tree_and_the_checkout_still_wins_inside_it(wheel, tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert _all_under(_imported_from(elsewhere, str(target)), target)
    assert _all_under(_imported_from(ROOT, str(target)), ROOT)
