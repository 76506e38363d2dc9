"""The audit trail on a real `mlxgw up` with keys: every change an admin or a model manager
makes over HTTP, the CLI, `mlxgw launch` and the console is recorded once with its actor,
before it is answered (a SIGKILL right after the answer loses nothing); refused attempts are
recorded; an edited entry is reported by `mlxgw audit verify` and GET /v1/audit; only admins
read it."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from helpers.fake_hub import hub_environment, tiny_model_hub
from helpers.gateway import REPO, start_gateway
from helpers.http import http
from helpers.lora_adapters import write_lora_adapter
from test_launch import launch, stand_in

from mlxgw.gateway.access.keys import ApiKey, hash_key

KEYS = {
    "admin": ("mlxgw-audit-admin-0123456789", {"admin": True}),
    "user": ("mlxgw-audit-user-0123456789", {}),
    "manager": ("mlxgw-audit-manager-0123456789", {"manage_models": True, "models": ["team-*"]}),
    "resident": ("mlxgw-audit-resident-0123456789", {"residency": True}),
}


def key_id(name: str) -> str:
    return ApiKey(name=name, sha256=hash_key(KEYS[name][0])).tenant


def write_keys(path) -> None:
    entries = [{"name": n, "sha256": hash_key(k), **extra} for n, (k, extra) in KEYS.items()]
    path.write_text(yaml.safe_dump({"keys": entries}))


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")  # a home of its own: its audit.jsonl is this module's
    allowed = root / "allowed"
    adapter = write_lora_adapter(tiny_dir, allowed / "tiny-lora", seed=1)
    write_keys(root / "keys.yaml")  # the default keys file: `mlxgw launch` creates keys in it
    config = {
        "manager": {"auto_discover": False, "allowed_import_paths": [str(allowed)]},
        "models": [
            {"name": "echo-agent", "engine": "echo", "preload": True, "aliases": ["claude-*"]},
            {"name": "tiny", "source": str(tiny_dir)},
        ],
    }
    hub = tiny_model_hub(tiny_dir)
    with hub_environment(hub, root):
        gw = start_gateway(root, config, "audit-gateway", extra_args=("--keys", str(root / "keys.yaml")))
    yield {"gw": gw, "root": root, "adapter": adapter}
    gw.stop()
    hub.stop()


def call(setup, method: str, path: str, body=None, key: str = "admin", headers=None):
    auth = {"Authorization": f"Bearer {KEYS[key][0]}", **(headers or {})}
    status, _, out = http(f"{setup['gw'].url}{path}", method, body, auth)
    return status, out


def trail(setup, **filters) -> list[dict]:
    query = "&".join(f"{k}={v}" for k, v in {"limit": 10000, **filters}.items())
    status, out = call(setup, "GET", f"/v1/audit?{query}")
    assert status == 200, out
    return out["data"]


def the_one(entries: list[dict], action: str, target: str, outcome: str = "ok") -> dict:
    found = [e for e in entries if e["action"] == action and e["target"] == target and e["outcome"] == outcome]
    assert len(found) == 1, (action, target, outcome, entries)
    return found[0]


def cli(setup, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLXGW_HOME=str(setup["root"]))
    cmd = [sys.executable, "-c", "from mlxgw.cli import main; main()", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_every_http_change_is_recorded_once_with_its_actor(setup):
    steps = [
        ("POST", "/v1/keys", {"name": "alice", "rpm": 5}, "admin", 201),
        ("PATCH", "/v1/keys/alice", {"tpm": 100, "admin": True}, "admin", 200),
        ("DELETE", "/v1/keys/alice", None, "admin", 200),
        ("POST", "/v1/models/echo-agent/pin", {"pinned": True}, "admin", 200),
        ("POST", "/v1/models/echo-agent/unload", None, "admin", 200),
        ("POST", "/v1/models/echo-agent/load", None, "admin", 200),
        ("DELETE", "/v1/cache?model=echo-agent", None, "admin", 200),
        ("POST", "/api/pull", {"model": "hf.co/org/tiny-mlx", "stream": True}, "admin", 200),
        ("POST", "/api/copy", {"source": "echo-agent", "destination": "team-base"}, "admin", 200),
        ("POST", "/api/create", {"model": "team-two", "from": "team-base", "system": "be brief"}, "manager", 200),
        ("POST", "/api/copy", {"source": "team-two", "destination": "team-three"}, "manager", 200),
        ("DELETE", "/api/delete", {"model": "team-three"}, "manager", 200),
        ("DELETE", "/api/delete", {"model": "tiny-mlx"}, "admin", 200),
        ("POST", "/v1/adapters", {"model": "tiny", "name": "tiny-lora", "path": str(setup["adapter"])}, "admin", 201),
        ("DELETE", "/v1/adapters/tiny-lora", None, "admin", 200),
        ("POST", "/api/generate", {"model": "echo-agent", "keep_alive": -1}, "resident", 200),  # pins it
        ("POST", "/api/generate", {"model": "echo-agent", "keep_alive": 0}, "resident", 200),  # unloads it
    ]
    for method, path, body, key, expected in steps:
        status, out = call(setup, method, path, body, key)
        assert status == expected, (path, status, out)
    time.sleep(0.5)  # keep_alive's entry is written as the request ends
    entries = trail(setup)
    admin = {"kind": "key", "name": "admin", "id": key_id("admin")}
    manager = {"kind": "key", "name": "manager", "id": key_id("manager")}
    resident = {"kind": "key", "name": "resident", "id": key_id("resident")}
    expected = [
        ("keys.create", "alice", admin, {"name": "alice", "rpm": 5}),
        ("keys.update", "alice", admin, {"tpm": 100, "admin": True}),
        ("keys.revoke", "alice", admin, {}),
        ("models.pin", "echo-agent", admin, {"pinned": True}),
        ("models.unload", "echo-agent", admin, {}),
        ("models.load", "echo-agent", admin, {}),
        ("cache.clear", "echo-agent", admin, {}),
        ("models.pull", "tiny-mlx", admin, None),
        ("models.copy", "team-base", admin, {"source": "echo-agent", "destination": "team-base"}),
        ("models.create", "team-two", manager, None),
        ("models.copy", "team-three", manager, None),
        ("models.delete", "team-three", manager, None),
        ("models.delete", "tiny-mlx", admin, None),
        ("adapters.add", "tiny-lora", admin, None),
        ("adapters.remove", "tiny-lora", admin, {}),
        ("models.keep_alive", "echo-agent", resident, {"keep_alive_s": "inf"}),
        ("models.unload", "echo-agent", resident, {"keep_alive": 0}),
    ]
    for action, target, actor, change in expected:
        entry = the_one([e for e in entries if e["actor"] == actor], action, target)
        assert change is None or entry["change"] == change, entry
        assert entry["request_id"] and entry["time"].endswith("Z")
    raw = (setup["root"] / "audit.jsonl").read_text()
    assert KEYS["admin"][0] not in raw and hash_key(KEYS["admin"][0]) not in raw and '"key":"mlxgw-' not in raw
    assert the_one(entries, "keys.create", "alice")["status"] == 201


def test_refused_attempts_are_recorded(setup):
    assert call(setup, "POST", "/v1/keys", {"name": "mallory", "admin": True}, "user")[0] == 403
    assert call(setup, "POST", "/v1/keys", {"name": "bob"}, "admin")[0] == 201
    assert call(setup, "PATCH", "/v1/keys/bob", {"rpm": -1}, "admin")[0] == 400
    assert call(setup, "DELETE", "/api/delete", {"model": "echo-agent"}, "manager")[0] == 403
    assert call(setup, "POST", "/api/generate", {"model": "echo-agent", "keep_alive": 0}, "user")[0] == 403
    assert call(setup, "DELETE", "/v1/keys/bob", None, "user")[0] == 403
    assert (
        call(setup, "POST", "/v1/keys", {"name": "eve"}, key="admin", headers={"Authorization": "Bearer no"})[0] == 401
    )
    entries = trail(setup, outcome="refused")
    mallory = the_one(entries, "keys.create", "mallory", "refused")
    assert mallory["actor"]["name"] == "user" and mallory["status"] == 403 and "admin key" in mallory["reason"]
    bad = the_one(entries, "keys.update", "bob", "refused")
    assert bad["actor"]["name"] == "admin" and bad["status"] == 400 and "rpm" in bad["reason"]
    assert the_one(entries, "models.delete", "echo-agent", "refused")["actor"]["name"] == "manager"
    assert the_one(entries, "models.unload", "echo-agent", "refused")["actor"]["name"] == "user"
    assert the_one(entries, "keys.revoke", "bob", "refused")["actor"]["id"] == key_id("user")
    assert not [e for e in entries if e["target"] == "eve"]  # a 401 has no identity: the access log has it


def test_the_cli_and_launch_changes_are_recorded(setup, tmp_path):
    assert cli(setup, "keys", "create", "carol", "--rpm", "7").returncode == 0
    assert cli(setup, "keys", "set", "carol", "tpm", "50").returncode == 0
    assert cli(setup, "keys", "set", "carol", "rpm", "lots").returncode == 2
    assert cli(setup, "keys", "revoke", "carol").returncode == 0
    user_home = tmp_path / "launcher"
    (user_home / "user").mkdir(parents=True)
    done = launch(
        user_home,
        setup["gw"].url,
        "claude",
        "--",
        "-p",
        "hi",
        path_dirs=[stand_in(tmp_path / "bin", "claude")],
        mlxgw_home=setup["root"],
    )
    assert done.returncode == 0, done.stderr
    listed = cli(setup, "audit", "--actor", "cli", "--jsonl")
    assert listed.returncode == 0, listed.stderr
    entries = [json.loads(line) for line in listed.stdout.splitlines()]
    me = {"kind": "cli", "user": getpass.getuser()}
    assert the_one(entries, "keys.create", "carol")["actor"] == me
    assert the_one(entries, "keys.create", "carol")["change"] == {"rpm": 7}
    assert the_one(entries, "keys.update", "carol")["change"] == {"tpm": 50}
    assert "rpm" in the_one(entries, "keys.update", "carol", "refused")["reason"]
    assert the_one(entries, "keys.revoke", "carol")["actor"] == me
    name = f"launch-{getpass.getuser()}"
    assert the_one(entries, "keys.create", name)["actor"] == {**me, "via": "launch"}
    assert the_one(entries, "keys.update", name)["change"] == {"models": ["echo-agent"]}
    table = cli(setup, "audit", "--action", "keys.", "--target", "carol")
    assert table.returncode == 0 and table.stdout.count("carol") == 4 and f"cli:{getpass.getuser()}" in table.stdout


def test_a_registry_reload_is_recorded(setup):
    os.kill(setup["gw"].proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not trail(setup, action="registry.reload"):
        time.sleep(0.2)
    entry = the_one(trail(setup), "registry.reload", str(setup["gw"].config_path))
    assert entry["actor"] == {"kind": "signal", "signal": "SIGHUP"} and set(entry["change"]) == {
        "added",
        "removed",
        "changed",
    }


def test_only_admins_read_the_trail_and_it_exports_as_json_lines(setup):
    for key in ("user", "manager", "resident"):
        status, out = call(setup, "GET", "/v1/audit", key=key)
        assert status == 403, out
    status, _, text = http(
        f"{setup['gw'].url}/v1/audit?action=keys.&limit=3",
        headers={"Authorization": f"Bearer {KEYS['admin'][0]}", "Accept": "application/x-ndjson"},
    )
    lines = text.splitlines() if isinstance(text, str) else [json.dumps(text)]
    assert (
        status == 200 and lines and len(lines) <= 3 and all(json.loads(x)["action"].startswith("keys.") for x in lines)
    )
    status, out = call(setup, "GET", "/v1/audit?limit=0")
    assert status == 400 and "limit" in out["error"]["message"]


def test_the_console_lists_the_trail(setup, tmp_path):
    from helpers.browser import browser_missing, headless_chromium
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if browser_missing():
        pytest.skip(browser_missing())
    driver = headless_chromium(tmp_path / "profile", 60)
    wait = WebDriverWait(driver, 30, poll_frequency=0.2)
    try:
        driver.get(f"{setup['gw'].url}/ui")
        wait.until(lambda d: d.find_element(By.ID, "login-key").is_displayed())
        driver.find_element(By.ID, "login-key").send_keys(KEYS["admin"][0])
        driver.find_element(By.ID, "login-submit").click()
        wait.until(lambda d: d.find_element(By.ID, "app").is_displayed())
        driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='keys']").click()
        driver.find_element(By.ID, "key-name").send_keys("from-console")
        driver.find_element(By.ID, "key-create").click()
        wait.until(lambda d: d.find_element(By.ID, "new-key").is_displayed())
        driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='audit']").click()
        wait.until(lambda d: "from-console" in d.find_element(By.ID, "audit-table").text)
        row = next(
            r for r in driver.find_elements(By.CSS_SELECTOR, "#audit-table tbody tr") if "from-console" in r.text
        )
        assert "admin" in row.text and "keys.create" in row.text and "ok 201" in row.text, row.text
        assert "chain unbroken" in driver.find_element(By.ID, "audit-chain").text
    finally:
        driver.quit()
    assert the_one(trail(setup), "keys.create", "from-console")["actor"]["name"] == "admin"


def test_an_edited_entry_is_reported_by_verify(setup):
    path = setup["root"] / "audit.jsonl"
    assert cli(setup, "audit", "verify").returncode == 0
    original = path.read_bytes()
    lines = original.decode().splitlines(keepends=True)
    victim = next(i for i, line in enumerate(lines) if '"target":"alice"' in line)
    seq = json.loads(lines[victim])["seq"]
    lines[victim] = lines[victim].replace('"name":"admin"', '"name":"someone"', 1)
    try:
        path.write_text("".join(lines))
        done = cli(setup, "audit", "verify")
        assert done.returncode == 1 and f"entry {seq}:" in done.stderr and "edited" in done.stderr, done.stderr
        status, out = call(setup, "GET", "/v1/audit?verify=true&limit=1")
        assert status == 200 and out["verify"]["ok"] is False and out["verify"]["first_bad"]["seq"] == seq
    finally:
        path.write_bytes(original)
    assert call(setup, "GET", "/v1/audit?verify=true&limit=1")[1]["verify"]["ok"] is True


def test_a_sigkill_right_after_an_acknowledged_change_loses_no_entry(tmp_path):
    root = tmp_path / "killed"
    root.mkdir()
    write_keys(root / "keys.yaml")
    config = {"manager": {"auto_discover": False}, "models": [{"name": "echo-agent", "engine": "echo"}]}
    gw = start_gateway(root, config, "audit-kill", extra_args=("--keys", str(root / "keys.yaml")))
    try:
        made = []
        for i in range(5):
            status, _, _ = http(
                f"{gw.url}/v1/keys", "POST", {"name": f"k{i}"}, {"Authorization": f"Bearer {KEYS['admin'][0]}"}
            )
            assert status == 201
            made.append(f"k{i}")
        os.kill(gw.proc.pid, signal.SIGKILL)  # the instant the last answer arrived
        gw.proc.wait(10)
    finally:
        gw.stop()
    entries = [json.loads(line) for line in (root / "audit.jsonl").read_text().splitlines()]
    assert [e["target"] for e in entries if e["action"] == "keys.create"] == made
    home = dict(os.environ, MLXGW_HOME=str(root))
    done = subprocess.run(
        [sys.executable, "-m", "mlxgw", "audit", "verify"], cwd=REPO, env=home, capture_output=True, text=True
    )
    assert done.returncode == 0 and "ok: 5 entries" in done.stdout, done.stdout + done.stderr
