"""A batch's end: its results streamed into its output and error files, its counts kept on
the batch, its requests' rows deleted (retention: the database keeps no prompt or answer
past the batch), then its final status. Never all results in memory at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

from .files import FILE_RETENTION_S, new_id, write_results
from .store import BatchStore

STAMPS = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at", "failed": "failed_at"}
PAGE = 256


def finalize(store: BatchStore, batch_id: str, status: str) -> None:
    """Requests never sent (cancelled, expired) appear in neither file, as with OpenAI. Safe to
    run again after a failure (a full disk): nothing is deleted until the files are written."""
    row = store._q("SELECT owner, input_file_id FROM batches WHERE id = ?", (batch_id,))[0]
    store._tx(
        [("UPDATE batches SET finalizing_at = COALESCE(finalizing_at, ?) WHERE id = ?", (int(time.time()), batch_id))]
    )
    counts = _counts(store, batch_id)
    now = int(time.time())
    files: dict[str, tuple[str, int] | None] = {}
    try:
        for state in ("done", "failed"):
            files[state] = None
            if counts[state]:
                file_id = new_id("file-")
                files[state] = (file_id, 0)  # named before it is written: removed if the write fails
                files[state] = (file_id, write_results(store.file_path(file_id), _results(store, batch_id, state)))
    except BaseException:
        for made in files.values():
            if made is not None:
                store.file_path(made[0]).unlink(missing_ok=True)
        raise
    statements = [
        (
            "INSERT INTO files VALUES (?, ?, 'batch_output', ?, ?, ?, ?)",
            (made[0], row["owner"], f"{batch_id}_{state}.jsonl", made[1], now, now + int(FILE_RETENTION_S)),
        )
        for state, made in files.items()
        if made is not None
    ]
    output, errors = (files[s][0] if files[s] else None for s in ("done", "failed"))
    statements += [
        (
            f"UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, {STAMPS[status]} = ?,"
            " total_n = ?, completed_n = ?, failed_n = ? WHERE id = ?",
            (status, output, errors, now, counts["total"], counts["done"], counts["failed"], batch_id),
        ),
        ("DELETE FROM batch_requests WHERE batch_id = ?", (batch_id,)),
    ]
    store._tx(statements)
    if not store.get_file(row["input_file_id"], row["owner"]):  # deleted while the batch ran
        store.file_path(row["input_file_id"]).unlink(missing_ok=True)


def _counts(store: BatchStore, batch_id: str) -> dict:
    rows = store._q("SELECT state, COUNT(*) AS n FROM batch_requests WHERE batch_id = ? GROUP BY state", (batch_id,))
    by_state = {r["state"]: r["n"] for r in rows}
    return {"total": sum(by_state.values()), "done": by_state.get("done", 0), "failed": by_state.get("failed", 0)}


def _results(store: BatchStore, batch_id: str, state: str) -> Iterator[str]:
    """The results of one state in order, a page at a time."""
    after = -1
    while True:
        rows = store._q(
            "SELECT idx, result FROM batch_requests WHERE batch_id = ? AND state = ? AND idx > ? ORDER BY idx LIMIT ?",
            (batch_id, state, after, PAGE),
        )
        if not rows:
            return
        for r in rows:
            yield r["result"]
        after = rows[-1]["idx"]
