"""The audit trail's hash chain (gateway/access/audit/store.py): an edited, deleted, reordered
or cut-off entry is reported at its place; retention drops the oldest and the rest verifies."""

from __future__ import annotations

import json
import time

from mlxgw.gateway.access.audit import bounded
from mlxgw.gateway.access.audit.store import AuditFile, iso


def trail(tmp_path, n: int = 5, **bounds) -> AuditFile:
    audit = AuditFile(tmp_path / "audit.jsonl", **bounds)
    for i in range(n):
        audit.append({"actor": {"kind": "cli", "user": "t"}, "action": "keys.create", "target": f"k{i}"})
    return audit


def rewrite(audit: AuditFile, edit) -> None:
    lines = audit.path.read_text().splitlines(keepends=True)
    audit.path.write_text("".join(edit(lines)))


def test_an_untouched_trail_verifies(tmp_path):
    audit = trail(tmp_path)
    result = audit.verify()
    assert result["ok"] and result["entries"] == 5 and result["first_bad"] is None
    assert [e["seq"] for e in audit.entries()] == [1, 2, 3, 4, 5]


def test_an_edited_entry_is_named(tmp_path):
    audit = trail(tmp_path)
    rewrite(audit, lambda lines: [*lines[:2], lines[2].replace('"k2"', '"someone-else"'), *lines[3:]])
    bad = audit.verify()["first_bad"]
    assert bad["seq"] == 3 and bad["line"] == 3 and "edited" in bad["problem"]


def test_a_deleted_entry_is_named(tmp_path):
    audit = trail(tmp_path)
    rewrite(audit, lambda lines: [*lines[:1], *lines[2:]])
    bad = audit.verify()["first_bad"]
    assert bad["line"] == 2 and "expected entry 2 here: it was deleted" in bad["problem"]


def test_reordered_entries_are_named(tmp_path):
    audit = trail(tmp_path)
    rewrite(audit, lambda lines: [lines[0], lines[2], lines[1], *lines[3:]])
    bad = audit.verify()["first_bad"]
    assert bad["line"] == 2 and "reordered" in bad["problem"]


def test_entries_cut_off_the_end_are_caught_by_the_head(tmp_path):
    audit = trail(tmp_path)
    rewrite(audit, lambda lines: lines[:3])
    bad = audit.verify()["first_bad"]
    assert bad["seq"] == 4 and "deleted from the end" in bad["problem"]


def test_the_last_entry_edited_is_caught_by_the_head(tmp_path):
    audit = trail(tmp_path)
    rewrite(audit, lambda lines: [*lines[:4], lines[4].replace('"k4"', '"k9"')])
    bad = audit.verify()["first_bad"]
    assert bad["seq"] == 5 and "edited" in bad["problem"]


def test_a_torn_last_line_is_dropped_and_the_chain_goes_on(tmp_path):
    audit = trail(tmp_path, 2)
    with open(audit.path, "ab") as f:
        f.write(b'{"seq":3,"time":"2026')  # a crash mid-write: never acknowledged
    audit.append({"action": "keys.revoke", "target": "k0"})
    assert audit.verify()["ok"] and [e["seq"] for e in audit.entries()] == [1, 2, 3]


def test_retention_by_age_keeps_the_rest_verifiable(tmp_path, monkeypatch):
    audit = AuditFile(tmp_path / "audit.jsonl", retention_days=1)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 3 * 86400)  # the store's clock, three days ago
    audit.append({"action": "keys.create", "target": "old-1"})
    audit.append({"action": "keys.create", "target": "old-2"})
    monkeypatch.setattr(time, "time", lambda: now)
    audit.append({"action": "keys.create", "target": "new-1"})
    assert json.loads(audit.path.read_text().splitlines()[0])["time"][:10] == iso(now - 3 * 86400)[:10]
    assert audit.prune() == 2
    result = audit.verify()
    assert result["ok"] and result["entries"] == 1 and result["anchor"]["dropped"] == 2
    assert [e["target"] for e in audit.entries()] == ["new-1"]
    audit.append({"action": "keys.revoke", "target": "new-1"})
    assert audit.verify()["ok"] and [e["seq"] for e in audit.entries()] == [3, 4]


def test_retention_by_size_drops_the_oldest_and_an_edit_after_it_is_still_caught(tmp_path):
    audit = trail(tmp_path, 40, max_bytes=2000)
    result = audit.verify()
    assert result["ok"] and result["anchor"] is not None and audit.path.stat().st_size < 2400
    kept = audit.entries()
    assert kept[-1]["seq"] == 40 and kept[0]["seq"] == result["anchor"]["next_seq"]
    rewrite(audit, lambda lines: [lines[0], lines[1].replace('"keys.create"', '"keys.update"'), *lines[2:]])
    assert audit.verify()["first_bad"]["seq"] == kept[0]["seq"]


def test_a_change_keeps_no_secret_and_no_unbounded_text():
    change = bounded({"name": "a", "sha256": "x" * 64, "key": "mlxgw-secret", "system": "y" * 5000, "n": float("inf")})
    assert "sha256" not in change and "key" not in change and len(change["system"]) < 300 and change["n"] == "inf"
