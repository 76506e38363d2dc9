"""Sign-in's pure parts: the provider's groups as roles and cache groups, the session table
(signed cookies, expiry, revocation, a restart), PKCE's S256 challenge, and personal keys'
owners in the keys file."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import pytest

from mlxgw.gateway.access.key_admin import KeyEditError, create_key, list_entries, revoke_key
from mlxgw.gateway.access.keys import KeyStore
from mlxgw.gateway.access.signin.people import is_person, person_from_claims
from mlxgw.gateway.access.signin.provider import pkce_pair
from mlxgw.gateway.access.signin.sessions import Sessions
from mlxgw.shared.gateway_config import GatewayConfig

T0 = time.time()  # sessions are saved as of the real clock
CONFIG = GatewayConfig(
    oidc_admin_groups=["ml-admins"], oidc_manage_models_groups=["ml-managers"], oidc_cache_groups=["team-a", "team-b"]
)


def test_groups_give_roles_and_the_first_configured_cache_group():
    claims = {"sub": "u1", "email": "bob@example.com", "groups": ["other", "team-b", "team-a", "ml-managers"]}
    bob = person_from_claims(claims, CONFIG)
    assert (bob.handle, bob.admin, bob.manage_models, bob.cache_group) == ("bob@example.com", False, True, "team-a")
    key = bob.as_key("https://idp")
    assert is_person(key) and key.name == "sso:bob@example.com" and key.owner_sub == "u1"
    assert key.tenant == person_from_claims({**claims, "groups": []}, CONFIG).as_key("https://idp").tenant
    nobody = person_from_claims({"sub": "u2", "groups": "ml-admins"}, CONFIG)  # a space-separated string
    assert (nobody.handle, nobody.admin, nobody.cache_group) == ("u2", True, None)
    with pytest.raises(ValueError):
        person_from_claims({"email": "x@y"}, CONFIG)


def test_a_handle_keeps_to_key_name_characters():
    person = person_from_claims({"sub": "s", "preferred_username": "Ann Lee/../admin"}, CONFIG)
    assert person.handle == "Ann-Lee-..-admin"


def test_a_session_cookie_is_signed_expires_and_is_revocable(tmp_path):
    alice = person_from_claims({"sub": "a", "email": "alice@example.com"}, CONFIG)
    sessions = Sessions(b"k" * 32, 3600, tmp_path / "sessions.json")
    cookie = sessions.create(alice, now=T0)
    assert sessions.lookup(cookie, now=T0 + 1).person == alice
    sid, sig = cookie.split(".")
    assert sessions.lookup(f"{sid}.{'A' * len(sig)}", now=T0 + 1) is None  # forged signature
    assert Sessions(b"other-secret" * 3, 3600, None).lookup(cookie, now=T0 + 1) is None
    assert sessions.lookup(cookie, now=T0 + 3600) is None  # expired
    sessions.save()
    assert cookie.split(".")[0] not in (tmp_path / "sessions.json").read_text()  # only its hash is kept
    restarted = Sessions(b"k" * 32, 3600, tmp_path / "sessions.json")
    session = restarted.lookup(cookie, now=T0 + 1)
    assert session is not None and session.person == alice
    assert restarted.revoke(session.id) and restarted.lookup(cookie, now=T0 + 1) is None


def test_pkce_challenge_is_the_verifiers_s256():
    verifier, challenge = pkce_pair()
    assert 43 <= len(verifier) <= 128
    digest = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
    assert challenge == digest


def test_personal_keys_carry_their_owner_and_only_the_owner_revokes_them(tmp_path):
    path = tmp_path / "keys.yaml"
    owner = {"owner": "bob@example.com", "owner_sub": "u1"}
    key, entry = create_key(path, "laptop.bob@example.com", {"cache_group": "team-b"}, owner, max_owned=1)
    assert entry["owner"] == "bob@example.com" and "sha256" not in json.dumps(entry)
    stored = KeyStore(path)
    assert stored.lookup(key).owner_sub == "u1" and not is_person(stored.lookup(key))  # a key, not a session
    with pytest.raises(KeyEditError, match="personal keys already"):
        create_key(path, "desk.bob@example.com", {}, owner, max_owned=1)
    with pytest.raises(KeyEditError, match="of yours"):
        revoke_key(path, "laptop.bob@example.com", owner_sub="someone-else")
    assert [e["name"] for e in list_entries(path, "u1")] == ["laptop.bob@example.com"]
    revoke_key(path, "laptop.bob@example.com", owner_sub="u1")
    assert list_entries(path) == []
