"""A per-step trace of a running worker, for finding where its steps' time goes.

With MLXGW_STEP_TRACE=/a/folder in the worker's environment each MLX worker writes
/a/folder/<pid>.jsonl: a first line naming what it serves, then one JSON line per engine
step: when it started and how long `BatchGenerator.next()` took (monotonic seconds), the
rows it decoded and those decoding after it, the tokens it generated and the prompt tokens
it read, whether it ran a speculative verification, the decode batch's attention width (its
KV write index) against the tokens its rows hold (the rest is padding), the BLAS threads it
ran on, and after it the rows of the second decode batch, those reading prompts and those
queued. It reads only Python-side state (no MLX array is evaluated), so tracing does not
change the pipelining it measures. Off (the default), nothing is recorded.
bench/step/trace.py summarises a folder of traces."""

from __future__ import annotations

import json
import logging
import os
import time

ENV = "MLXGW_STEP_TRACE"
log = logging.getLogger(__name__)


class StepTrace:
    def __init__(self, folder: str, header: dict):
        path = os.path.join(folder, f"{os.getpid()}.jsonl")
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker
        self._file.write(json.dumps({"header": header}) + "\n")

    @classmethod
    def from_env(cls, header: dict) -> StepTrace | None:
        """The trace MLXGW_STEP_TRACE asks for; None when unset, or when its folder cannot be
        written (a diagnosis setting must not stop a model from loading: it is logged)."""
        folder = os.environ.get(ENV)
        if not folder:
            return None
        try:
            return cls(folder, header)
        except OSError as e:
            log.warning("%s=%s: no step trace (%s)", ENV, folder, e)
            return None

    def record(self, gen, started: float, rows: int, emitted: int, read: int, speculative: bool, threads) -> None:
        """After one step that decoded `rows` rows: `emitted` tokens generated, `read` prompt
        tokens prefilled."""
        batch = gen.decode_batch
        caches = getattr(batch, "prompt_cache", None) or []
        width = getattr(caches[0], "_idx", None) if caches else None
        line = {
            "t": round(started, 6),
            "next_s": round(time.monotonic() - started, 6),
            "rows": rows,
            "rows_after": len(batch),
            "emitted": emitted,
            "read": read,
            "spec": speculative,
            "width": width if isinstance(width, int) else None,
            "held": sum(len(t) for t in batch.tokens) if len(batch) else 0,
            "side": gen.side_rows,  # rows decoding in the second decode batch (rows_after is mlx-lm's)
            "reading": gen.reading,  # rows reading their prompts after the step
            "queued": gen.queued,  # rows inserted, not yet reading
            "threads": threads,
        }
        self._file.write(json.dumps(line) + "\n")
