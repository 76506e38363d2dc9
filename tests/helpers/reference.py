"""Reference runs of MLX code outside the server."""

from __future__ import annotations

import subprocess
import sys

from mlxgw.shared.platform import worker_environment


def run_reference(script: str) -> str:
    """Run MLX code in a fresh process with the same environment a worker gets (BLAS)."""
    out = subprocess.run(
        [sys.executable, "-c", script], env=worker_environment(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout
