"""Rate limits and token budgets belong to a key, not to its name, against a real `mlxgw up`
with the echo engine: a key revoked and created again under the same name (over the keys
API) starts with nothing used, and a key renamed in the keys file (its hash kept) keeps what
it used, across a restart too (the budgets are seeded from the ledger by identity)."""

from __future__ import annotations

import os

import pytest
import yaml
from helpers import http, start_gateway

from mlxgw.gateway.access.keys import hash_key

ADMIN = "mlxgw-ident-admin-0123456789"
KEYS = {"eve": "mlxgw-ident-eve-0123456789", "fay": "mlxgw-ident-fay-0123456789"}
CONFIG = {"manager": {"auto_discover": False}, "models": [{"name": "echo", "engine": "echo", "preload": True}]}
TPD = 40


def _write_keys(path, entries: list[dict]) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(yaml.safe_dump({"window_seconds": 600, "keys": entries}))
    os.replace(tmp, path)


def _entries(**renames) -> list[dict]:
    return [
        {"name": "admin", "sha256": hash_key(ADMIN), "admin": True},
        {"name": renames.get("eve", "eve"), "sha256": hash_key(KEYS["eve"]), "rpm": 2},
        {"name": renames.get("fay", "fay"), "sha256": hash_key(KEYS["fay"]), "tpd": TPD},
    ]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    home = tmp_path_factory.mktemp("ident-home")
    keys_path = home / "keys.yaml"
    _write_keys(keys_path, _entries())
    started = start_gateway(home, CONFIG, "ident", extra_args=("--keys", str(keys_path)))
    started.home, started.keys_path = home, keys_path
    yield started
    started.stop()


def _chat(gw, key: str, text: str = "hello there, a few words") -> tuple[int, dict]:
    body = {"model": "echo", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    status, _, payload = http(f"{gw.url}/v1/chat/completions", "POST", body, headers={"Authorization": f"Bearer {key}"})
    return status, payload


def _admin(gw, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    status, _, payload = http(f"{gw.url}{path}", method, body, headers={"Authorization": f"Bearer {ADMIN}"})
    return status, payload


def _spend_budget(gw, key: str) -> None:
    for _ in range(20):
        status, payload = _chat(gw, key)
        if status == 429:
            assert "daily token budget" in payload["error"]["message"], payload
            return
        assert status == 200, payload
    raise AssertionError(f"a {TPD}-token-a-day key was never refused")


def test_a_key_created_again_under_a_revoked_keys_name_starts_with_nothing_used(gw):
    assert [_chat(gw, KEYS["eve"])[0] for _ in range(3)] == [200, 200, 429]
    _spend_budget(gw, KEYS["fay"])
    for name, limits in (("eve", {"rpm": 2}), ("fay", {"tpd": TPD})):
        assert _admin(gw, "DELETE", f"/v1/keys/{name}")[0] == 200
        status, created = _admin(gw, "POST", "/v1/keys", {"name": name, **limits})
        assert status == 201, created
        status, payload = _chat(gw, created["key"])
        assert status == 200, f"the new key {name!r} inherited the revoked key's counters: {payload}"


def test_a_renamed_key_keeps_its_limits_and_budget_across_a_restart(gw):
    _write_keys(gw.keys_path, _entries())
    statuses = [_chat(gw, KEYS["eve"])[0] for _ in range(3)]
    assert statuses[-1] == 429, statuses
    _spend_budget(gw, KEYS["fay"])
    _write_keys(gw.keys_path, _entries(eve="eve-renamed", fay="fay-renamed"))
    status, payload = _chat(gw, KEYS["eve"])
    assert status == 429 and "eve-renamed" in payload["error"]["message"], payload
    status, payload = _chat(gw, KEYS["fay"])
    assert status == 429 and "daily token budget" in payload["error"]["message"], payload
    gw.stop()
    again = start_gateway(gw.home, CONFIG, "ident-again", extra_args=("--keys", str(gw.keys_path)))
    try:
        status, payload = _chat(again, KEYS["fay"])
        assert status == 429 and "fay-renamed" in payload["error"]["message"], payload
        status, listed = http(f"{again.url}/v1/keys", headers={"Authorization": f"Bearer {ADMIN}"})[::2]
        usage = {k["name"]: k["usage"]["budget_tokens_today"] for k in listed["data"]}
        assert usage["fay-renamed"] >= TPD, usage
    finally:
        again.stop()
