"""Run the real `mlxgw` command line in a fresh process with its own MLXGW_HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mlxgw(*args: str, home: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, MLXGW_HOME=str(home), **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", "from mlxgw.cli import main; main()", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_clean_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2 with an `error:` line naming the problem: no crash, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "error:" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr[-2000:])
