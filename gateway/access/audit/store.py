"""The audit trail's file: JSON lines under $MLXGW_HOME, append-only, hash-chained.

Each line is one entry, written whole and fsynced before the change it records is answered;
its `prev` is the SHA-256 of the previous line's bytes (the first line's is 64 zeros), so an
edited, deleted or reordered entry breaks the chain at that place. A side file (`.head`) keeps
the last entry's seq and hash: cutting entries off the end is caught too. Retention drops the
oldest entries and writes an anchor as the first line (what was dropped, and the hash the next
kept entry continues from), so the kept part still verifies.

A plain file rather than SQLite: appending one line and fsyncing it is the whole write, the
bytes hashed are the bytes stored (no re-serialisation to agree on), anyone can read, export
or check it with standard tools, and the CLI and the gateway share it under one flock."""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ....shared.atomic_file import write_atomically

log = logging.getLogger(__name__)

GENESIS = "0" * 64
ANCHOR = "audit.anchor"
_TAIL_BYTES = 1 << 16  # an entry is far smaller (values are bounded in record.py)


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _dumps(entry: dict) -> bytes:
    return (json.dumps(entry, separators=(",", ":"), ensure_ascii=False, default=str) + "\n").encode()


class AuditFile:
    """One audit file and its lock; every method is blocking (the gateway calls it in a thread)."""

    def __init__(self, path: Path, retention_days: float | None = None, max_bytes: int | None = None):
        self.path = path
        self.head_path = path.with_name(path.name + ".head")
        self.retention_days = retention_days
        self.max_bytes = max_bytes

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # -- writing ------------------------------------------------------------------------------
    def append(self, entry: dict) -> dict:
        """Write `entry` (seq, time and prev added) as the next line, fsynced; returns it."""
        with self._locked():
            with open(self.path, "a+b") as f:
                seq, prev = self._last(f)
                written = {"seq": seq + 1, "time": iso(time.time()), **entry, "prev": prev}
                line = _dumps(written)
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            self._write_head(seq + 1, line_hash(line))
            if self.max_bytes is not None and size > self.max_bytes:
                self._prune_locked(time.time())
        return written

    def _last(self, f) -> tuple[int, str]:
        """(seq, hash) of the last whole line; a torn last line (a crash mid-write: never
        acknowledged) is cut off first."""
        f.seek(0, os.SEEK_END)
        end = f.tell()
        if end == 0:
            return 0, GENESIS
        f.seek(max(0, end - _TAIL_BYTES))
        tail = f.read()
        if not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n") + 1
            log.warning("audit: dropping a torn last line of %s (a write cut by a crash)", self.path)
            f.truncate(end - (len(tail) - cut))
            tail = tail[:cut]
            if not tail:
                return self._last(f)
        last = tail[:-1].rsplit(b"\n", 1)[-1]
        entry = json.loads(last)
        if entry.get("action") == ANCHOR:
            return int(entry["next_seq"]) - 1, str(entry["resume"])
        return int(entry["seq"]), line_hash(last)

    def _write_head(self, seq: int, digest: str) -> None:
        write_atomically(self.head_path, json.dumps({"seq": seq, "hash": digest}) + "\n", sync_folder=False)

    # -- retention ----------------------------------------------------------------------------
    def prune(self, now: float | None = None) -> int:
        """Drop entries past the retention bound; returns how many were dropped."""
        with self._locked():
            return self._prune_locked(now or time.time())

    def _prune_locked(self, now: float) -> int:
        if not self.path.exists() or (self.retention_days is None and self.max_bytes is None):
            return 0
        lines = self.path.read_bytes().splitlines(keepends=True)
        anchor = json.loads(lines[0]) if lines and json.loads(lines[0]).get("action") == ANCHOR else None
        body = lines[1:] if anchor else lines
        drop = 0
        if self.retention_days is not None:
            cutoff = now - self.retention_days * 86400
            while drop < len(body) and parse_time(json.loads(body[drop])["time"]) < cutoff:
                drop += 1
        if self.max_bytes is not None:
            size = sum(map(len, body[drop:]))
            while drop < len(body) and size > self.max_bytes * 0.9:  # room, so it is not every append
                size -= len(body[drop])
                drop += 1
        if drop == 0:
            return 0
        last = json.loads(body[drop - 1])
        new_anchor = {
            "action": ANCHOR,
            "time": iso(now),
            "dropped": drop + (anchor or {}).get("dropped", 0),
            "dropped_through": last["seq"],
            "next_seq": last["seq"] + 1,
            "resume": line_hash(body[drop - 1]),
            "previous_anchor": line_hash(lines[0]) if anchor else None,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_dumps(new_anchor))
            f.writelines(body[drop:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        log.info("audit: dropped %d entries past the retention bound (through seq %d)", drop, last["seq"])
        return drop

    # -- reading ------------------------------------------------------------------------------
    def lines(self) -> list[bytes]:
        with self._locked():
            try:
                return self.path.read_bytes().splitlines()
            except FileNotFoundError:
                return []

    def entries(self) -> list[dict]:
        out = []
        for raw in self.lines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue  # verify reports it; a listing shows what it can
            if isinstance(entry, dict) and entry.get("action") != ANCHOR:
                out.append(entry)
        return out

    def verify(self) -> dict:
        """{"ok", "entries", "first_bad": {seq, line, problem} | None, "anchor"}: the first
        place the chain breaks, i.e. the first entry edited, deleted or out of order."""
        lines = self.lines()
        with self._locked():
            head = json.loads(self.head_path.read_text()) if self.head_path.exists() else None
        return verify_lines(lines, head)


def _bad(n: int, seq, problem: str) -> dict:
    return {"line": n, "seq": seq, "problem": problem}


def _seq_of(raw: bytes):
    try:
        return json.loads(raw).get("seq")
    except (ValueError, AttributeError):
        return None


def verify_lines(lines: list[bytes], head: dict | None) -> dict:
    expected_seq, expected_prev, anchor = 1, GENESIS, None
    hashes: dict[int, str] = {}
    result = {"ok": True, "entries": 0, "first_bad": None, "anchor": None}
    for n, raw in enumerate(lines, start=1):
        try:
            entry = json.loads(raw)
            seq = entry.get("seq") if entry.get("action") != ANCHOR else None
        except (ValueError, AttributeError):
            return {**result, "ok": False, "first_bad": _bad(n, None, "not a JSON object: the line was edited")}
        if entry.get("action") == ANCHOR:
            if n != 1:
                return {**result, "ok": False, "first_bad": _bad(n, None, "a retention anchor inside the trail")}
            anchor = result["anchor"] = entry
            expected_seq, expected_prev = int(entry["next_seq"]), str(entry["resume"])
            hashes[expected_seq - 1] = expected_prev
            continue
        if seq != expected_seq:
            later = any(_seq_of(x) == expected_seq for x in lines[n:])
            why = f"expected entry {expected_seq} here: " + ("entries were reordered" if later else "it was deleted")
            return {**result, "ok": False, "first_bad": _bad(n, seq, why)}
        if entry.get("prev") != expected_prev:
            where = f"entry {seq - 1} (line {n - 1})" if n > 1 and not (n == 2 and anchor) else "the trail's start"
            why = f"{where} was edited, or this entry's prev was: the chain breaks here"
            return {**result, "ok": False, "first_bad": _bad(n - 1 if n > 1 else n, seq - 1, why)}
        expected_prev = hashes[seq] = line_hash(raw)
        expected_seq += 1
        result["entries"] += 1
    return _check_head({**result, "anchor": anchor}, head, expected_seq - 1, hashes)


def _check_head(result: dict, head: dict | None, last_seq: int, hashes: dict[int, str]) -> dict:
    if head is None:
        return result
    seq, digest = int(head.get("seq", 0)), head.get("hash")
    if seq > last_seq:
        why = f"entries {last_seq + 1}..{seq} were deleted from the end"
        return {**result, "ok": False, "first_bad": _bad(None, last_seq + 1, why)}
    if seq in hashes and hashes[seq] != digest:
        return {**result, "ok": False, "first_bad": _bad(None, seq, f"entry {seq}, the last one written, was edited")}
    return result


def matches(
    entry: dict,
    since: float | None,
    actor: str | None = None,
    action: str | None = None,
    target: str | None = None,
    outcome: str | None = None,
) -> bool:
    """The listing's filters: actor is a key's name or id, "cli" or an OS user; action is exact
    or a prefix ending in "." ("keys." is every key change)."""
    if since is not None and parse_time(entry.get("time", "1970-01-01T00:00:00Z")) < since:
        return False
    who = entry.get("actor") or {}
    if actor is not None and actor not in (who.get("name"), who.get("id"), who.get("kind"), who.get("user")):
        return False
    act = str(entry.get("action", ""))
    if action is not None and not (act == action or (action.endswith(".") and act.startswith(action))):
        return False
    if target is not None and entry.get("target") != target:
        return False
    return outcome is None or entry.get("outcome") == outcome
