"""A worker's helper process, for tests of the gateway's memory budget (tests only).

MLX's CPU backend compiles its kernels with g++: while a worker loads, cc1plus processes of
100-112 MB each run under it (measured on Linux), and a worker killed mid-compile leaves
them running after it has exited. MLXGW_TEST_CHILD_MB starts one such process under the
worker holding that many MB for the worker's life; MLXGW_TEST_CHILD_LINGER_S keeps it that
many seconds after the worker is gone, as an orphaned compile finishes its job."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD_MB_ENV = "MLXGW_TEST_CHILD_MB"
LINGER_ENV = "MLXGW_TEST_CHILD_LINGER_S"

_CHILD = """
import os, sys, time
held = b"x" * (int(sys.argv[1]) << 20)  # written, so resident
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))
"""


def start_helper_child() -> subprocess.Popen | None:
    mb = int(os.environ.get(CHILD_MB_ENV) or 0)
    if mb <= 0:
        return None
    linger = os.environ.get(LINGER_ENV) or "0"
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(mb), linger], stdin=subprocess.DEVNULL)
