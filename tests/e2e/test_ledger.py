"""The usage ledger: every finished request in SQLite, reported by `mlxgw usage` and
GET /v1/usage, kept across restarts and a kill -9 (up to the documented window), and the
daily and monthly token budgets read from it."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml
from helpers import REPO, http, start_gateway

from mlxgw.gateway.access.keys import hash_key
from mlxgw.gateway.access.ledger import FLUSH_S, Ledger, connect

KEYS = {
    "alice": "mlxgw-ledger-alice-0123456789",
    "bob": "mlxgw-ledger-bob-0123456789",
    "root": "mlxgw-ledger-root-0123456789",
    "capped": "mlxgw-ledger-capped-0123456789",
    "monthly": "mlxgw-ledger-monthly-0123456789",
}
DAILY_BUDGET = 50
CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "echo", "engine": "echo", "preload": True},
        {"name": "null", "engine": "null", "preload": True, "max_num_seqs": 32, "max_queue": 128},
    ],
}
MSGS = [{"role": "user", "content": "count these words please"}]


@pytest.fixture(scope="module")
def ledger_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("ledger-home")
    (home / "keys.yaml").write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "alice", "sha256": hash_key(KEYS["alice"])},
                    {"name": "bob", "sha256": hash_key(KEYS["bob"])},
                    {"name": "root", "sha256": hash_key(KEYS["root"]), "admin": True},
                    {"name": "capped", "sha256": hash_key(KEYS["capped"]), "tpd": DAILY_BUDGET},
                    {"name": "monthly", "sha256": hash_key(KEYS["monthly"]), "tpmo": 30},
                ]
            }
        )
    )
    return home


def start(home, name="ledger-gateway"):
    return start_gateway(home, CONFIG, name, extra_args=("--keys", str(home / "keys.yaml")))


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def chat(gw, key: str, model: str = "null", max_tokens: int = 6, **extra):
    body = {"model": model, "max_tokens": max_tokens, "messages": MSGS, **extra}
    return http(f"{gw.url}/v1/chat/completions", "POST", body, auth(key))


def usage_cli(home, *args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", "from mlxgw.cli import main; main()", "usage", "--format", "json", *args],
        cwd=REPO,
        env=dict(os.environ, MLXGW_HOME=str(home)),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def by_key(rows: list[dict]) -> dict[str, dict]:
    return {r["key"]: r for r in rows}


def api_usage(gw, **query) -> list[dict]:
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    status, _, body = http(f"{gw.url}/v1/usage?{qs}", headers=auth("root"))
    assert status == 200, body
    return body["data"]


def run_workload(gw) -> dict[str, dict]:
    """Requests of several APIs and outcomes; returns what the clients counted per key."""
    counted = {k: {"requests": 0, "errors": 0, "prompt": 0, "completion": 0} for k in ("alice", "bob")}

    def count(key, status, body, prompt_field="prompt_tokens", completion_field="completion_tokens"):
        c = counted[key]
        c["requests"] += 1
        if status >= 400:
            c["errors"] += 1
            return
        c["prompt"] += body["usage"][prompt_field]
        c["completion"] += body["usage"][completion_field]

    for i in range(6):
        key = "alice" if i % 2 else "bob"
        status, _, body = chat(gw, key, model="null" if i % 3 else "echo", max_tokens=3 + i)
        count(key, status, body)
    for _ in range(2):
        body = {"model": "null", "max_tokens": 4, "prompt": "one two three"}
        status, _, out = http(f"{gw.url}/v1/completions", "POST", body, auth("alice"))
        count("alice", status, out)
    body = {"model": "null", "max_tokens": 5, "messages": MSGS}
    status, _, out = http(f"{gw.url}/v1/messages", "POST", body, {"x-api-key": KEYS["bob"]})
    count("bob", status, out, "input_tokens", "output_tokens")
    status, _, out = chat(gw, "alice", model="no-such-model")
    assert status == 404
    count("alice", status, out)
    return counted


def assert_totals(rows: list[dict], counted: dict[str, dict]) -> None:
    got = by_key(rows)
    for key, c in counted.items():
        assert got[key]["requests"] == c["requests"], (key, got[key])
        assert got[key]["errors"] == c["errors"], (key, got[key])
        assert got[key]["prompt_tokens"] == c["prompt"], (key, got[key])
        assert got[key]["completion_tokens"] == c["completion"], (key, got[key])


def test_usage_totals_equal_what_the_clients_counted_after_a_restart_too(ledger_home):
    gw = start(ledger_home)
    try:
        counted = run_workload(gw)
        assert_totals(api_usage(gw, since="1h", by="key"), counted)
        time.sleep(FLUSH_S + 0.5)  # the CLI reads what is committed
        assert_totals(usage_cli(ledger_home, "--since", "1h"), counted)
        by_api = {r["api"]: r["requests"] for r in api_usage(gw, since="1h", by="api")}
        assert by_api["chat"] == 7 and by_api["completions"] == 2 and by_api["messages"] == 1
    finally:
        assert gw.stop() == 0
    assert_totals(usage_cli(ledger_home, "--since", "1h"), counted)
    gw = start(ledger_home, "ledger-gateway-2")
    try:
        assert_totals(api_usage(gw, since="1h", by="key"), counted)
        # Counting goes on across the restart: both lifetimes add up.
        again = run_workload(gw)
        both = {k: {f: counted[k][f] + again[k][f] for f in counted[k]} for k in counted}
        assert_totals(api_usage(gw, since="1h", by="key"), both)
    finally:
        assert gw.stop() == 0
    assert_totals(usage_cli(ledger_home, "--since", "1h"), both)


def test_rows_carry_key_names_never_keys(ledger_home):
    db = (ledger_home / "usage.db").read_bytes() + b"".join(
        p.read_bytes() for p in ledger_home.glob("usage.db-*") if p.is_file()
    )
    assert db and b"alice" in db
    for key in KEYS.values():
        assert key.encode() not in db and hash_key(key).encode() not in db


def test_kill_9_loses_at_most_the_last_flush_window(tmp_path, ledger_home):
    (tmp_path / "keys.yaml").write_text((ledger_home / "keys.yaml").read_text())
    gw = start(tmp_path, "ledger-kill")
    settled, recent = 20, 10
    for _ in range(settled):
        assert chat(gw, "alice")[0] == 200
    time.sleep(FLUSH_S + 0.5)  # older than the window: must survive
    for _ in range(recent):
        assert chat(gw, "alice")[0] == 200
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(30)
    conn = sqlite3.connect(tmp_path / "usage.db")
    (stored,) = conn.execute("SELECT COUNT(*) FROM requests WHERE key = 'alice'").fetchone()
    conn.close()
    print(f"\nkill -9: {stored} of {settled + recent} rows kept ({settled} finished over {FLUSH_S} s before)")
    assert settled <= stored <= settled + recent
    # The file is sound: a new gateway opens it and keeps counting.
    for child in gw.descendants():
        os.kill(child, signal.SIGKILL)
    gw = start(tmp_path, "ledger-kill-2")
    try:
        assert chat(gw, "alice")[0] == 200
        assert by_key(api_usage(gw, since="1h"))["alice"]["requests"] == stored + 1
    finally:
        gw.stop()


def seconds_to_utc_midnight() -> float:
    now = dt.datetime.now(dt.timezone.utc)
    tomorrow = dt.datetime(now.year, now.month, now.day, tzinfo=dt.timezone.utc) + dt.timedelta(days=1)
    return (tomorrow - now).total_seconds()


def test_daily_token_budget_refuses_at_the_boundary_and_after_a_restart(ledger_home):
    gw = start(ledger_home, "ledger-budget")
    try:
        used = 0
        while used < DAILY_BUDGET:
            status, headers, body = chat(gw, "capped", max_tokens=20)
            assert status == 200, body
            used += body["usage"]["total_tokens"]
            assert headers["x-ratelimit-limit-tokens-day"] == str(DAILY_BUDGET)
            assert headers["x-ratelimit-remaining-tokens-day"] == str(max(0, DAILY_BUDGET - used))
        status, headers, body = chat(gw, "capped")
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert "daily token budget" in body["error"]["message"]
        assert headers["x-ratelimit-remaining-tokens-day"] == "0"
        assert abs(int(headers["retry-after"]) - seconds_to_utc_midnight()) < 10
        body = {"model": "null", "max_tokens": 5, "messages": MSGS}
        status, _, out = http(f"{gw.url}/v1/messages", "POST", body, {"x-api-key": KEYS["capped"]})
        assert status == 429 and out["error"]["type"] == "rate_limit_error"
        assert chat(gw, "alice")[0] == 200  # other keys are not affected
    finally:
        gw.stop()
    gw = start(ledger_home, "ledger-budget-2")
    try:  # the budget is read back from the ledger
        status, headers, _ = chat(gw, "capped")
        assert status == 429 and headers["x-ratelimit-remaining-tokens-day"] == "0"
    finally:
        gw.stop()


def test_monthly_token_budget_refuses_once_spent(ledger_home):
    gw = start(ledger_home, "ledger-monthly")
    try:
        status, headers, body = chat(gw, "monthly", max_tokens=40)
        assert status == 200 and headers["x-ratelimit-limit-tokens-month"] == "30"
        assert headers["x-ratelimit-remaining-tokens-month"] == "0"
        status, headers, body = chat(gw, "monthly")
        assert status == 429 and "monthly token budget" in body["error"]["message"]
        assert int(headers["retry-after"]) > 0
    finally:
        gw.stop()


def test_retention_deletes_rows_older_than_the_setting(tmp_path):
    db = tmp_path / "usage.db"
    conn = connect(db)
    old = time.time() - 3 * 86400
    conn.execute(
        "INSERT INTO requests (ts, key, model, api, status, latency_s) VALUES (?, 'old', 'm', 'chat', 200, 0.1)", (old,)
    )
    conn.close()
    ledger = Ledger(db, retention_days=2)
    ledger.start()
    ledger.record((time.time(), "r1", "new", "m", "chat", 200, "stop", 1, 0, 2, 0, 0.0, 0.01, 0.005, None, 0))
    ledger.close()
    conn = connect(db)
    keys = [k for (k,) in conn.execute("SELECT key FROM requests")]
    conn.close()
    assert keys == ["new"]


def test_usage_cli_groups_and_formats(ledger_home):
    days = usage_cli(ledger_home, "--since", "all", "--by", "day")
    assert days and all(len(r["day"]) == 10 for r in days)
    out = subprocess.run(
        [sys.executable, "-c", "from mlxgw.cli import main; main()", "usage", "--by", "model", "--format", "csv"],
        cwd=REPO,
        env=dict(os.environ, MLXGW_HOME=str(ledger_home)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.splitlines()[0].startswith("model,requests,errors,prompt_tokens")
    bad = subprocess.run(
        [sys.executable, "-c", "from mlxgw.cli import main; main()", "usage", "--since", "yesterday-ish"],
        cwd=REPO,
        env=dict(os.environ, MLXGW_HOME=str(ledger_home)),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "cannot parse" in bad.stderr


def test_embedding_requests_record_their_inputs(tmp_path, minilm_dir):
    """The ledger's per-API extras: an embeddings request counts its inputs (and tokens)."""
    config = {
        "manager": {"auto_discover": False, "models_dir": str(minilm_dir.parent)},
        "models": [{"name": "minilm-l6", "kind": "embedding", "preload": True}],
    }
    keys = [
        {"name": "alice", "sha256": hash_key(KEYS["alice"])},
        {"name": "root", "sha256": hash_key(KEYS["root"]), "admin": True},
    ]
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": keys}))
    gw = start_gateway(tmp_path, config, "ledger-embeddings", extra_args=("--keys", str(tmp_path / "keys.yaml")))
    try:
        body = {"model": "minilm-l6", "input": ["one", "two words", "three more words"]}
        status, _, out = http(f"{gw.url}/v1/embeddings", "POST", body, auth("alice"))
        assert status == 200, out
        row = by_key(api_usage(gw, since="1h", by="key"))["alice"]
        assert row["embedding_inputs"] == 3 and row["prompt_tokens"] == out["usage"]["prompt_tokens"]
        assert [r["api"] for r in api_usage(gw, since="1h", by="api")] == ["embeddings"]
    finally:
        gw.stop()


def test_a_full_disk_loses_no_row_once_space_returns(tmp_path, ledger_home):
    """RLIMIT_FSIZE on the running gateway (psutil's prlimit) fails every file write past one
    byte with EFBIG, as a full disk does: the ledger's commits fail, its rows are kept and
    written once the limit is lifted (they used to be dropped with an error line)."""
    import resource

    import psutil

    (tmp_path / "keys.yaml").write_text((ledger_home / "keys.yaml").read_text())
    gw = start(tmp_path, "ledger-full-disk")
    proc = psutil.Process(gw.proc.pid)
    try:
        assert chat(gw, "alice")[0] == 200
        before = by_key(api_usage(gw, since="all"))["alice"]["requests"]  # flushed: the file exists
        proc.rlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
        for _ in range(20):
            assert chat(gw, "alice")[0] == 200
        time.sleep(FLUSH_S * 2)  # at least one commit fails meanwhile
        proc.rlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        deadline = time.monotonic() + 15
        while (got := by_key(api_usage(gw, since="all"))["alice"]["requests"]) < before + 20:
            assert time.monotonic() < deadline, f"{got - before} of 20 rows written after the disk came back"
            time.sleep(0.5)
        assert got == before + 20
    finally:
        proc.rlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        gw.stop()
