"""The OpenAI Files and Batch APIs with the official openai SDK against `mlxgw up`:
upload, create, poll, output and error files, cancel, a key sees only its own, the batch's
requests in the usage ledger as batch:*, and a batch that survives a gateway kill without
any request answered twice."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time

import openai
import psutil
import pytest
import yaml
from helpers import NO_EOS, http, start_gateway
from helpers.mlxgw_cli import mlxgw

from mlxgw.gateway.access.keys import hash_key

KEYS = {"alice": "mlxgw-batch-alice-0123456789", "bob": "mlxgw-batch-bob-0123456789", "ops": "mlxgw-batch-ops-0123"}
BATCH_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "echo", "engine": "echo", "preload": True, "max_num_seqs": 8},
        {"name": "tiny-bg", "source": "tiny", "preload": True, "max_num_seqs": 2, "max_queue": 32},
    ],
}


def _keys_file(home) -> str:
    path = home / "batch-keys.yaml"
    entries = [{"name": n, "sha256": hash_key(k), "admin": n == "ops"} for n, k in KEYS.items()]
    path.write_text(yaml.safe_dump({"keys": entries}))
    return str(path)


def _own_home(home, name: str):
    """A home of its own, sharing the session's models: every gateway on one home runs that
    home's batches (one at a time, claimed), and the session's other gateways share `home`."""
    own = home / name
    own.mkdir(exist_ok=True)
    if not (own / "models").exists():
        (own / "models").symlink_to(home / "models")
    return own


@pytest.fixture(scope="module")
def batch_gateway(home, tiny_dir):
    gw = start_gateway(
        _own_home(home, "batch-home"), BATCH_CONFIG, "batch-gateway", extra_args=("--keys", _keys_file(home))
    )
    yield gw
    gw.stop()


def _client(gw, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS[name], max_retries=0, timeout=60)


def _jsonl(lines: list[dict]) -> io.BytesIO:
    data = io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())
    data.name = "input.jsonl"
    return data


def _chat_line(custom_id: str, content: str, model: str = "echo", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def _output(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_through_the_sdk_with_output_and_error_files(batch_gateway):
    alice = _client(batch_gateway, "alice")
    lines = [_chat_line(f"req-{i}", f"answer {i}") for i in range(6)]
    lines.append(_chat_line("bad-model", "x", model="no-such-model"))
    uploaded = alice.files.create(file=_jsonl(lines), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "eval"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "eval"}
    done = _wait_done(alice, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 6, 1)
    out = _output(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(6))
    for x in out:
        assert x["response"]["status_code"] == 200
        content = x["response"]["body"]["choices"][0]["message"]["content"]
        assert content == f"answer {x['custom_id'].split('-')[1]}"
    (err,) = _output(alice, done.error_file_id)
    assert err["custom_id"] == "bad-model" and err["response"]["status_code"] == 404
    assert batch.id in [b.id for b in alice.batches.list()]
    # Bob sees none of it.
    bob = _client(batch_gateway, "bob")
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(done.output_file_id)
    assert batch.id not in [b.id for b in bob.batches.list()]
    # The console's view (admins only) lists every key's batches with their owner.
    everyone = f"{batch_gateway.url}/v1/batches?all=true"
    assert http(everyone, headers={"Authorization": f"Bearer {KEYS['bob']}"})[0] == 403
    listed = http(everyone, headers={"Authorization": f"Bearer {KEYS['ops']}"})[2]["data"]
    assert {"id": batch.id, "owner": "alice"}.items() <= next(b for b in listed if b["id"] == batch.id).items()
    # The ledger records each request of the batch, for its key, as batch:<api>.
    db = sqlite3.connect(batch_gateway.log_path.parent / "usage.db")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = db.execute("SELECT key, api FROM requests WHERE request_id LIKE ?", (f"{batch.id}-%",)).fetchall()
        if len(rows) == 7:
            break
        time.sleep(0.3)
    assert len(rows) == 7 and set(rows) == {("alice", "batch:chat")}
    home = batch_gateway.log_path.parent
    out = mlxgw("usage", "--by", "api", home=home)
    assert "batch:chat" in out.stdout and "batch jobs" in out.stdout and "alice" in out.stdout


def test_a_bad_input_file_fails_the_batch_with_line_numbers(batch_gateway):
    alice = _client(batch_gateway, "alice")
    bad = [_chat_line("a", "x"), {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}]
    uploaded = alice.files.create(file=_jsonl(bad), purpose="batch")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors.data[0].line == 2
    with pytest.raises(openai.BadRequestError):
        alice.files.create(file=_jsonl(bad), purpose="fine-tune")


def test_a_cancelled_batch_stops_and_keeps_what_was_answered(batch_gateway):
    alice = _client(batch_gateway, "alice")
    lines = [_chat_line(f"c{i}", "go", model="tiny-bg", max_tokens=40, logit_bias=NO_EOS) for i in range(30)]
    batch = alice.batches.create(
        input_file_id=alice.files.create(file=_jsonl(lines), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    _wait(lambda: alice.batches.retrieve(batch.id).request_counts.completed >= 1)
    alice.batches.cancel(batch.id)
    done = _wait_done(alice, batch.id)
    assert done.status == "cancelled" and 1 <= done.request_counts.completed < 30


def _wait(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_a_batch_survives_a_gateway_kill_and_no_request_is_answered_twice(home, batch_gateway):
    """The module's last test: it kills the module's gateway (kill -9) mid-batch."""
    home2, keys, gw = home / "batch-home", _keys_file(home), batch_gateway
    alice = _client(gw, "alice")
    lines = [_chat_line(f"r{i}", "go", model="tiny-bg", max_tokens=30, logit_bias=NO_EOS) for i in range(24)]
    batch = alice.batches.create(
        input_file_id=alice.files.create(file=_jsonl(lines), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    _wait(lambda: alice.batches.retrieve(batch.id).request_counts.completed >= 4)
    children = gw.descendants()
    gw.stop(signal.SIGKILL)
    for pid in children:  # this gateway's workers, orphaned by the kill
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    db = sqlite3.connect(home2 / "batches.db")
    sql = "SELECT idx FROM batch_requests WHERE batch_id = ? AND state != 'pending'"
    answered = {r[0] for r in db.execute(sql, (batch.id,))}
    assert 4 <= len(answered) < 24, "the kill came mid-batch"
    gw2 = start_gateway(home2, BATCH_CONFIG, "batch-restart-2", extra_args=("--keys", keys))
    try:
        done = _wait_done(_client(gw2, "alice"), batch.id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 24
        out = _output(_client(gw2, "alice"), done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(24)), "each request once"
        resent = {i for i in range(24) if f"{batch.id}-{i}-" in gw2.log()}
        assert resent and not resent & answered, "a request answered before the kill was sent again"
    finally:
        gw2.stop()
    assert os.path.exists(home2 / "files")


def test_a_graceful_restart_mid_batch_sends_no_request_twice(home, tiny_dir):
    """SIGTERM (what `mlxgw restart`, launchd and systemd send) mid-batch: the requests in
    flight finish and are recorded before the gateway exits, so the next gateway sends only
    the ones never sent, and every request of the batch ran exactly once. (Only a kill -9
    can lose an answer in flight, which the next gateway then sends again: the test above.)"""
    own, keys = _own_home(home, "batch-graceful"), _keys_file(home)
    gw = start_gateway(own, BATCH_CONFIG, "batch-graceful-1", extra_args=("--keys", keys))
    try:
        alice = _client(gw, "alice")
        lines = [_chat_line(f"g{i}", "go", model="tiny-bg", max_tokens=30, logit_bias=NO_EOS) for i in range(16)]
        batch = alice.batches.create(
            input_file_id=alice.files.create(file=_jsonl(lines), purpose="batch").id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        _wait(lambda: alice.batches.retrieve(batch.id).request_counts.completed >= 2)
    finally:
        gw.stop()  # SIGTERM, then the graceful drain
    first = {i for i in range(16) if f"{batch.id}-{i}-" in gw.log()}
    cut = [ln for ln in gw.log().splitlines() if f"request_id={batch.id}-" in ln and "status=200" not in ln]
    assert not cut, f"the stop cut batch requests in flight instead of letting them finish: {cut}"
    gw2 = start_gateway(own, BATCH_CONFIG, "batch-graceful-2", extra_args=("--keys", keys))
    try:
        done = _wait_done(_client(gw2, "alice"), batch.id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 16
        out = _output(_client(gw2, "alice"), done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"g{i}" for i in range(16)), "each request once"
        second = {i for i in range(16) if f"{batch.id}-{i}-" in gw2.log()}
        assert first and second and not first & second, (first, second)
    finally:
        gw2.stop()


def test_one_gateway_process_runs_a_batch_until_it_dies(tmp_path):
    """Two gateways on one MLXGW_HOME: the batch's claim keeps it with one live process."""
    from mlxgw.gateway.batches.store import BatchStore

    store = BatchStore(tmp_path)
    store.begin_batch("batch_x", None, None, "/v1/chat/completions", "file-x", None)
    store.add_requests("batch_x", [(0, "a", 1, 0, 10, "m")])
    batch = store.end_creation("batch_x", None, [])
    me, dead = os.getpid(), _dead_pid()
    assert store.claim(batch["id"], dead, stale_s=30)
    assert store.claim(batch["id"], me, stale_s=30), "a dead holder's claim is taken over"
    assert not store.claim(batch["id"], os.getppid(), stale_s=30), "a live holder keeps it"
    assert store.claim(batch["id"], os.getppid(), stale_s=0), "unless it stopped renewing"
    store.close()


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
