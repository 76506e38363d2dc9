"""Every difference between macOS (Metal) and Linux (CPU/CUDA) lives here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IS_MACOS = sys.platform == "darwin"
IS_LINUX = sys.platform.startswith("linux")

# The Linux CPU wheel of MLX bundles a reference BLAS (~3 GFLOP/s for float32 matmul).
# Debian's libopenblas0-pthread put in front of it with LD_PRELOAD reached ~100 GFLOP/s
# on our 2-core machines, which is what makes float32 the fastest dtype there.
_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def on_cpu_device() -> bool:
    """Whether MLX computes on the CPU here (Linux's mlx[cpu]; not Metal or CUDA): the CPU's
    own attention, BLAS threads, sampling slices and speculation cap apply only then."""
    import mlx.core as mx

    return mx.default_device().type == mx.cpu


def openblas_path() -> str | None:
    if not IS_LINUX:
        return None
    for candidate in _OPENBLAS_CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return None


@dataclass(frozen=True)
class BlasThreads:
    """Get and set the CPU BLAS's thread count at run time (process-wide)."""

    get: Callable[[], int]
    set: Callable[[int], None]


def blas_threads() -> BlasThreads | None:
    """The thread control of an OpenBLAS loaded in this process (Linux, preloaded by
    worker_environment), or None: on macOS the matmuls run on Metal, and Accelerate has no
    such call; a GPU build's matmuls do not use the CPU BLAS (the caller checks the device)."""
    if not IS_LINUX:
        return None
    import ctypes

    try:
        lib = ctypes.CDLL(None)  # the global namespace, where LD_PRELOAD put OpenBLAS
        get, set_ = lib.openblas_get_num_threads, lib.openblas_set_num_threads
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, []
    set_.restype, set_.argtypes = None, [ctypes.c_int]
    return BlasThreads(get=get, set=set_)


def worker_environment(base: dict[str, str] | None = None, *, use_openblas: bool = True) -> dict:
    """Environment for a spawned MLX worker process."""
    env = dict(os.environ if base is None else base)
    blas = openblas_path() if use_openblas else None
    if blas and blas not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{blas} {env['LD_PRELOAD']}".strip() if env.get("LD_PRELOAD") else blas
    # A worker must never try the network for a model or tokenizer.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def default_import_dtype() -> str:
    """Measured: on Linux CPU float32 (+OpenBLAS) decodes ~2.4x faster than bfloat16 and 4-bit
    is several times slower still; on Apple silicon bfloat16 is the usual choice."""
    return "bfloat16" if IS_MACOS else "float32"


def total_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def reexec_as_worker(module: str) -> None:
    """Re-run `python -m module` with the environment workers get (OpenBLAS preloaded on
    Linux), so in-process measurements compare like with like. Returns in the child."""
    if os.environ.get("MLXGW_AS_WORKER") == "1":
        return
    env = worker_environment()
    env["MLXGW_AS_WORKER"] = "1"
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


# Set by a gateway on the `mlxgw models` children it runs for Ollama's /api/pull and
# /api/create: the gateway's pid, so a child whose gateway was killed stops too.
EXIT_WITH_PARENT_ENV = "MLXGW_EXIT_WITH_PARENT"


def exit_with_parent(poll_s: float = 0.2) -> None:
    """Exit as soon as the process named by MLXGW_EXIT_WITH_PARENT is no longer our parent
    (it was killed: we were reparented). Its request is gone, and an import finishing after
    it would leave a model folder no entry lists. Polling getppid works on macOS and Linux
    (PR_SET_PDEATHSIG is Linux's only). The import's temp folder is removed at next start."""
    expected = os.environ.pop(EXIT_WITH_PARENT_ENV, "")
    if not expected.isdigit():
        return
    import threading
    import time

    def watch() -> None:
        while os.getppid() == int(expected):
            time.sleep(poll_s)
        os._exit(70)  # EX_SOFTWARE: nothing to flush; the import's temp folder stays for the cleanup

    if os.getppid() != int(expected):
        os._exit(70)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
