"""mlx_lm sets the process's descriptor limit to (2048, 4096) when it is first imported
(mlx_lm/utils.py, "for large models with lots of files"). Under a hard limit below 4096
(`ulimit -Hn 1024`, some service managers) that call raises ValueError and the worker exits
before it says hello: every model, the null engine included, crash-loops and is marked
failed. Called by the worker's commands before anything imports mlx_lm."""

from __future__ import annotations

import resource

MLX_LM_HARD_LIMIT = 4096


def tolerate_a_low_file_limit() -> None:
    """Under a hard descriptor limit below mlx_lm's, clip its request to the hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard >= MLX_LM_HARD_LIMIT:
        return
    setrlimit = resource.setrlimit

    def within_the_hard_limit(which: int, limits: tuple[int, int]) -> None:
        if which == resource.RLIMIT_NOFILE:
            ceiling = resource.getrlimit(which)[1]
            limits = (min(limits[0], ceiling), min(limits[1], ceiling))
        setrlimit(which, limits)

    resource.setrlimit = within_the_hard_limit
