"""The tree is ruff-clean (pyproject's rules), so style drift fails CI rather than piling up:
the layout change that made `mlxgw` first-party left 90 unsorted import blocks unnoticed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO
# mlxgw/<part> link the top-level folders: the real folders, each file once (as `make lint`).
FOLDERS = ["gateway", "worker", "shared", "bench", "tests"]
PATHS = [*(str(p.relative_to(ROOT)) for p in (ROOT / "mlxgw").glob("*.py")), *FOLDERS]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (the test extra installs it)")
    out = subprocess.run([ruff, "check", *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
