"""API keys over HTTP for admin keys: create (the key shown once), list, patch, revoke (at
once, for new and queued requests), on the same file `mlxgw keys` edits; 403 for other
keys; never a key or a hash in a response or in the log."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from helpers import LONG, NO_EOS, REPO, http, start_gateway

from mlxgw.gateway.access.keys import hash_key

ROOT = "mlxgw-keysapi-root-0123456789"
USER = "mlxgw-keysapi-user-0123456789"
HOG = "mlxgw-keysapi-hog-0123456789"
ISSUED: list[str] = [ROOT, USER, HOG]  # every key this module sees: none may leak
RESPONSES: list[str] = []
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def keys_gateway(home, tiny_dir, tmp_path_factory):
    keys_path = tmp_path_factory.mktemp("keys-api") / "keys.yaml"
    keys_path.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "root", "sha256": hash_key(ROOT), "admin": True},
                    {"name": "user", "sha256": hash_key(USER)},
                    {"name": "hog", "sha256": hash_key(HOG)},
                ]
            }
        )
    )
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "tiny-serial", "source": "tiny", "preload": True, "max_num_seqs": 1, "max_queue": 8},
            {"name": "null", "engine": "null", "preload": True},
            {"name": "tiny-lazy", "source": "tiny", "max_num_seqs": 1},  # loads on first use
        ],
    }
    gw = start_gateway(home, config, "keys-api-gateway", extra_args=("--keys", str(keys_path), "--log-format", "json"))
    gw.keys_path = keys_path
    yield gw
    gw.stop()


def call(gw, path: str, method: str = "GET", body=None, key: str = ROOT):
    status, headers, out = http(f"{gw.url}{path}", method, body, {"Authorization": f"Bearer {key}"})
    RESPONSES.append(f"{headers}\n{out}")
    return status, headers, out


def chat(gw, key: str, model: str = "null"):
    return call(gw, "/v1/chat/completions", "POST", {"model": model, "max_tokens": 3, "messages": MSGS}, key)


def cli(gw, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from mlxgw.cli import main; main()", "keys", *args, "--file", str(gw.keys_path)],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
    )


def test_create_use_patch_and_revoke_with_the_cli_on_the_same_file(keys_gateway):
    gw = keys_gateway
    status, _, made = call(gw, "/v1/keys", "POST", {"name": "dora", "rpm": 100, "models": ["null"]})
    assert status == 201 and made["key"].startswith("mlxgw-") and "sha256" not in made
    ISSUED.append(made["key"])
    assert chat(gw, made["key"])[0] == 200
    listed = cli(gw, "list").stdout
    assert "dora" in listed and "rpm=100" in listed and "models=null" in listed

    status, _, patched = call(gw, "/v1/keys/dora", "PATCH", {"rpm": 2, "tpd": 5000})
    assert status == 200 and patched["rpm"] == 2 and patched["tpd"] == 5000
    assert "rpm=2," in cli(gw, "list").stdout
    statuses = [chat(gw, made["key"])[0] for _ in range(2)]
    assert statuses == [200, 429]  # one of the 2 was used before: the new limit holds at once

    created = cli(gw, "create", "eve", "--tpm", "9000")  # the CLI edits the file the gateway serves
    assert created.returncode == 0, created.stderr
    ISSUED.append(created.stdout.strip())
    assert chat(gw, created.stdout.strip())[0] == 200
    names = {k["name"]: k for k in call(gw, "/v1/keys")[2]["data"]}
    assert names["eve"]["tpm"] == 9000 and names["dora"]["last_used"] is not None
    assert names["dora"]["usage"]["today"]["requests"] >= 2

    status, _, gone = call(gw, "/v1/keys/dora", "DELETE")
    assert status == 200 and gone["deleted"] is True
    assert chat(gw, made["key"])[0] == 401  # at once
    assert "dora" not in cli(gw, "list").stdout
    assert cli(gw, "revoke", "eve").returncode == 0
    assert chat(gw, created.stdout.strip())[0] == 401


def test_bad_edits_are_clear_400s_and_404s(keys_gateway):
    gw = keys_gateway
    assert call(gw, "/v1/keys", "POST", {"name": "user"})[0] == 400  # exists
    assert call(gw, "/v1/keys", "POST", {"name": "../etc"})[0] == 400
    assert call(gw, "/v1/keys", "POST", {"name": "x", "rpm": -1})[0] == 400
    assert call(gw, "/v1/keys", "POST", {"name": "x", "sha256": "0" * 64})[0] == 400  # not settable
    assert call(gw, "/v1/keys/nobody", "PATCH", {"rpm": 1})[0] == 404
    assert call(gw, "/v1/keys/nobody", "DELETE")[0] == 404
    status, _, out = call(gw, "/v1/keys/user", "PATCH", {"expires": "soon"})
    assert status == 400 and "ISO time" in out["error"]["message"]


def test_non_admin_keys_get_403_on_every_admin_route(keys_gateway):
    gw = keys_gateway
    routes = [
        ("/v1/keys", "GET", None),
        ("/v1/keys", "POST", {"name": "mallory"}),
        ("/v1/keys/user", "PATCH", {"rpm": 100000}),
        ("/v1/keys/root", "DELETE", None),
        ("/v1/usage", "GET", None),
        ("/v1/status/requests", "GET", None),
        ("/v1/models/null/unload", "POST", {}),
        ("/v1/models/null/load", "POST", {}),
        ("/v1/models/null/pin", "POST", {}),
    ]
    for path, method, body in routes:
        status, _, out = call(gw, path, method, body, key=USER)
        assert status == 403 and out["error"]["type"] == "permission_error", (path, method, out)
    assert any(k["name"] == "root" for k in call(gw, "/v1/keys")[2]["data"])


def test_revoking_a_key_ends_its_queued_requests_at_once(keys_gateway):
    import openai

    gw = keys_gateway
    victim = call(gw, "/v1/keys", "POST", {"name": "victim"})[2]["key"]
    ISSUED.append(victim)
    hog = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=HOG, max_retries=0)
    stream = hog.chat.completions.create(
        model="tiny-serial", messages=MSGS, max_tokens=LONG, stream=True, extra_body={"logit_bias": NO_EOS}
    )
    chunks = iter(stream)
    next(chunks)  # the only sequence slot is taken
    result: dict = {}

    def queued_request() -> None:
        body = {"model": "tiny-serial", "max_tokens": 3, "messages": MSGS}
        result["status"], _, result["body"] = http(
            f"{gw.url}/v1/chat/completions", "POST", body, {"Authorization": f"Bearer {victim}"}
        )
        result["ended"] = time.monotonic()

    waiter = threading.Thread(target=queued_request)
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = call(gw, "/v1/status/requests")[2]["running"]
            if any(r["key"] == "victim" for r in running):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the victim's request never showed up as in flight")
        revoked_at = time.monotonic()
        status, _, out = call(gw, "/v1/keys/victim", "DELETE")
        assert status == 200 and out["queued_ended"] == 1
        waiter.join(15)
        assert not waiter.is_alive(), "the queued request of a revoked key kept waiting"
        assert result["status"] == 499 and result["ended"] - revoked_at < 10, result
        for _ in range(3):  # the other key's stream goes on
            next(chunks)
    finally:
        stream.close()
        waiter.join(30)
    assert chat(gw, victim)[0] == 401


def test_a_revoked_keys_request_waiting_for_a_model_to_load_never_runs(keys_gateway):
    gw = keys_gateway
    victim = call(gw, "/v1/keys", "POST", {"name": "late"})[2]["key"]
    ISSUED.append(victim)
    result: dict = {}

    def waiting_request() -> None:
        body = {"model": "tiny-lazy", "max_tokens": 3, "messages": MSGS}
        result["status"], _, result["body"] = http(
            f"{gw.url}/v1/chat/completions", "POST", body, {"Authorization": f"Bearer {victim}"}
        )

    waiter = threading.Thread(target=waiting_request)
    waiter.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = call(gw, "/v1/status/requests")[2]["running"]
        if any(r["key"] == "late" and r["state"] == "waiting" for r in running):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the request never showed up as waiting")
    assert call(gw, "/v1/keys/late", "DELETE")[2]["queued_ended"] == 1
    waiter.join(120)
    assert result["status"] == 499, result  # cancelled as soon as it reached the worker


def test_cli_and_http_editing_at_once_lose_no_key(keys_gateway):
    gw = keys_gateway

    def over_http(i: int) -> int:
        status, _, out = call(gw, "/v1/keys", "POST", {"name": f"web-{i}"})
        ISSUED.append(out.get("key", ""))
        return status

    def over_cli(i: int) -> int:
        done = cli(gw, "create", f"cli-{i}")
        ISSUED.append(done.stdout.strip())
        return done.returncode

    with ThreadPoolExecutor(8) as pool:
        web = list(pool.map(over_http, range(6)))
        shell = list(pool.map(over_cli, range(6)))
    assert web == [201] * 6 and shell == [0] * 6
    names = {k["name"] for k in yaml.safe_load(gw.keys_path.read_text())["keys"]}
    assert {f"web-{i}" for i in range(6)} | {f"cli-{i}" for i in range(6)} <= names
    assert {k["name"] for k in call(gw, "/v1/keys")[2]["data"]} == names


def test_no_key_or_hash_ever_appears_in_a_response_or_the_log(keys_gateway):
    gw = keys_gateway
    log = gw.log()
    assert "/v1/keys" in log  # the access log saw the key routes
    everything = "\n".join(RESPONSES)
    issued = [k for k in ISSUED if k]
    assert len(issued) >= 10
    for key in issued:
        assert key not in log and hash_key(key) not in log
        assert hash_key(key) not in everything
    for key in (ROOT, USER, HOG):  # the keys that were presented, never created here
        assert key not in everything


def test_admin_unloads_loads_and_pins_a_model_over_http(keys_gateway):
    import psutil

    gw = keys_gateway

    def null_status() -> dict:
        return next(m for m in call(gw, "/v1/status")[2]["models"] if m["name"] == "null")

    pid = null_status()["workers"][0]["pid"]
    assert psutil.pid_exists(pid)
    status, _, out = call(gw, "/v1/models/null/unload", "POST", {})
    assert status == 200 and out["state"] == "unloaded"
    assert not psutil.pid_exists(pid) or _zombie(pid)  # the worker process has ended
    status, _, out = call(gw, "/v1/models/null/load", "POST", {})
    assert status == 200 and out["state"] == "ready" and out["loaded"] is True
    assert chat(gw, USER)[0] == 200
    status, _, out = call(gw, "/v1/models/null/pin", "POST", {"pinned": True})
    assert status == 200 and out["pinned"] is True and null_status()["pinned"] is True
    assert call(gw, "/v1/models/null/pin", "POST", {"pinned": False})[2]["pinned"] is False
    assert call(gw, "/v1/models/no-such/load", "POST", {})[0] == 404


def _zombie(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
