"""Sign-in with the team's identity provider, against a real OpenID provider (oidc-provider
from npm) and a real `mlxgw up` with keys: the console's authorization code flow with PKCE
in headless Chromium, groups mapped to roles and cache groups, a personal key made in the
console and used for a chat (named in the ledger and the audit trail), sessions ended by
signing out and by an admin refused, and the provider's JWT access tokens accepted while
forged, expired and wrongly addressed ones are refused."""

from __future__ import annotations

import base64
import time

import jwt
import pytest
import yaml
from helpers.browser import browser_missing, headless_chromium
from helpers.gateway import start_gateway
from helpers.http import free_port, http
from helpers.oidc import install_oidc_provider, rsa_jwk, start_oidc_provider

from mlxgw.gateway.access.keys import hash_key

ADMIN = "mlxgw-signin-admin-0123456789"
CLIENT_ID, CLIENT_SECRET = "mlxgw-console", "signin-test-client-secret"
AUDIENCE = "https://mlxgw.test/api"
ACCOUNTS = {
    "alice": {"email": "alice@example.com", "groups": ["ml-admins", "team-a"]},
    "bob": {"email": "bob@example.com", "groups": ["team-b", "ml-managers", "unrelated"]},
}
CHAT = {"model": "echo", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    missing = install_oidc_provider()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("signin")
    (root / "keys.yaml").write_text(
        yaml.safe_dump({"keys": [{"name": "root", "sha256": hash_key(ADMIN), "admin": True}]})
    )
    oidc_port = free_port()
    config = {
        "gateway": {
            "oidc_issuer": f"http://127.0.0.1:{oidc_port}",
            "oidc_client_id": CLIENT_ID,
            "oidc_client_secret": CLIENT_SECRET,
            "oidc_admin_groups": ["ml-admins"],
            "oidc_manage_models_groups": ["ml-managers"],
            "oidc_cache_groups": ["team-a", "team-b"],
            "oidc_accept_access_tokens": True,
            "oidc_audience": AUDIENCE,
        },
        "manager": {"auto_discover": False},
        "models": [{"name": "echo", "engine": "echo", "preload": True}],
    }
    # The gateway first (it discovers the provider on first use): the provider needs its redirect URI.
    gw = start_gateway(root, config, "signin-gateway", extra_args=("--keys", str(root / "keys.yaml")))
    provider = start_oidc_provider(
        root,
        oidc_port,
        {
            "client_id": CLIENT_ID,
            "client_secret": CLIENT_SECRET,
            "redirect_uri": f"{gw.url}/auth/callback",
            "audience": AUDIENCE,
            "accounts": ACCOUNTS,
            "service_groups": ["team-a"],
        },
    )
    yield {"gw": gw, "provider": provider, "root": root}
    gw.stop()
    provider.stop()


def admin(setup, method, path, body=None):
    return http(f"{setup['gw'].url}{path}", method, body, {"Authorization": f"Bearer {ADMIN}"})


def as_cookie(setup, cookie, method="GET", path="/v1/me", body=None, console=True, origin=None):
    headers = {"Cookie": f"mlxgw_session={cookie}", **({"X-Mlxgw-Console": "1"} if console else {})}
    headers |= {"Origin": origin} if origin else {}
    return http(f"{setup['gw'].url}{path}", method, body, headers)


def wait_until(driver, condition, what: str, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d), f"timed out: {what}")


def browser_sign_in(driver, gw, account: str) -> str:
    """The whole flow: the console's button, the provider's login and consent pages, back to the
    console; returns the session cookie the gateway set."""
    from selenium.webdriver.common.by import By

    driver.get(f"{gw.url}/ui/")
    wait_until(driver, lambda d: d.find_element(By.ID, "login-sso-link").is_displayed(), "the sign-in button")
    driver.find_element(By.ID, "login-sso-link").click()
    wait_until(driver, lambda d: d.find_elements(By.NAME, "login"), "the provider's login page")
    driver.find_element(By.NAME, "login").send_keys(account)
    driver.find_element(By.NAME, "password").send_keys("any password")
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_until(driver, lambda d: "/interaction/" not in d.current_url or d.find_elements(By.NAME, "prompt"), "consent")
    if "/interaction/" in driver.current_url:  # the consent page
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_until(driver, lambda d: d.find_element(By.ID, "app").is_displayed(), "the console after sign-in")
    return driver.get_cookie("mlxgw_session")["value"]


@pytest.fixture
def browser(tmp_path):
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    driver = headless_chromium(tmp_path / "chromium-profile", 60)
    yield driver
    driver.quit()


def test_a_signed_in_person_gets_their_roles_makes_a_personal_key_and_signing_out_ends_the_session(setup, browser):
    """bob: no admin group, so only his own keys; his manager group and first cache group apply."""
    from selenium.webdriver.common.by import By

    gw, driver = setup["gw"], browser
    bob_cookie = browser_sign_in(driver, gw, "bob")
    assert driver.find_element(By.ID, "whoami").text == "bob@example.com"
    assert driver.find_element(By.ID, "tab-mine").is_displayed()
    assert not driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='overview']").is_displayed()
    status, _, me = as_cookie(setup, bob_cookie)
    assert status == 200, me
    assert (me["kind"], me["person"], me["admin"]) == ("person", "bob@example.com", False)
    assert (me["manage_models"], me["cache_group"]) == (True, "team-b")
    assert as_cookie(setup, bob_cookie, "GET", "/v1/keys")[0] == 403  # not an admin
    assert as_cookie(setup, bob_cookie, "POST", "/v1/me/keys", {"label": "x"}, console=False)[0] == 403  # no header
    assert as_cookie(setup, bob_cookie, origin="http://127.0.0.1:1")[0] == 403  # another port's page: same site
    assert as_cookie(setup, bob_cookie, origin=gw.url)[0] == 200

    driver.find_element(By.ID, "mine-label").send_keys("laptop")
    driver.find_element(By.ID, "mine-create").click()
    wait_until(driver, lambda d: d.find_element(By.ID, "mine-new-value").text, "the new personal key")
    key = driver.find_element(By.ID, "mine-new-value").text
    assert driver.find_element(By.ID, "mine-new-name").text == "laptop.bob@example.com"
    status, _, out = http(f"{gw.url}/v1/chat/completions", "POST", CHAT, {"Authorization": f"Bearer {key}"})
    assert status == 200, out
    status, _, me = http(f"{gw.url}/v1/me", headers={"Authorization": f"Bearer {key}"})
    assert (me["kind"], me["person"], me["cache_group"], me["admin"]) == ("key", "bob@example.com", "team-b", False)
    usage = admin(setup, "GET", "/v1/usage?by=key")[2]["data"]
    assert any(r["key"] == "laptop.bob@example.com" and r["requests"] >= 1 for r in usage), usage
    trail = admin(setup, "GET", "/v1/audit?action=keys.create&limit=100")[2]["data"]
    made = [e for e in trail if e["target"] == "laptop.bob@example.com"]
    assert len(made) == 1 and made[0]["actor"]["person"] == "bob@example.com", trail
    assert made[0]["actor"]["name"] == "sso:bob@example.com" and made[0]["outcome"] == "ok"

    driver.find_element(By.ID, "mine-label").send_keys("desk")  # a second key, revoked in the console
    driver.find_element(By.ID, "mine-create").click()
    wait_until(driver, lambda d: d.find_element(By.ID, "mine-new-name").text == "desk.bob@example.com", "desk")
    desk = {"Authorization": f"Bearer {driver.find_element(By.ID, 'mine-new-value').text}"}
    assert http(f"{gw.url}/v1/me", headers=desk)[0] == 200
    revoke = "button[data-key='desk.bob@example.com']"
    wait_until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, revoke), "desk's revoke button")
    driver.find_element(By.CSS_SELECTOR, revoke).click()
    wait_until(driver, lambda d: http(f"{gw.url}/v1/me", headers=desk)[0] == 401, "the revoked key refused", 10)

    driver.find_element(By.ID, "sign-out").click()  # ends the session on the gateway, not only in the tab
    wait_until(driver, lambda d: d.find_element(By.ID, "login").is_displayed(), "the sign-in page again")
    wait_until(driver, lambda d: as_cookie(setup, bob_cookie)[0] == 401, "the signed-out session refused", 10)
    assert http(f"{gw.url}/v1/me", headers={"Authorization": f"Bearer {key}"})[0] == 200  # his key lives on

    assert bob_cookie not in gw.log()  # cookies are never logged


def test_an_admin_group_member_gets_the_whole_console_until_an_admin_revokes_the_session(setup, browser):
    from selenium.webdriver.common.by import By

    gw, driver = setup["gw"], browser
    alice_cookie = browser_sign_in(driver, gw, "alice")
    wait_until(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#models-table tr[data-model='echo']"), "models")
    status, _, me = as_cookie(setup, alice_cookie)
    assert (me["admin"], me["cache_group"]) == (True, "team-a")
    assert as_cookie(setup, alice_cookie, "GET", "/v1/keys")[0] == 200
    sessions = admin(setup, "GET", "/v1/sessions")[2]["data"]
    [alice] = [s for s in sessions if s["name"] == "alice@example.com"]
    assert admin(setup, "DELETE", f"/v1/sessions/{alice['id']}")[0] == 200
    status, _, out = as_cookie(setup, alice_cookie)
    assert status == 401 and "session" in out["error"]["message"], out
    assert alice_cookie not in gw.log()


def client_credentials_token(setup) -> str:
    basic = base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
    status, _, out = http(
        f"{setup['provider'].issuer}/token",
        "POST",
        raw=f"grant_type=client_credentials&scope=api&resource={AUDIENCE}".encode(),
        headers={"Authorization": f"Basic {basic}", "content-type": "application/x-www-form-urlencoded"},
    )
    assert status == 200, out
    return out["access_token"]


def signed(key, kid: str, **claims) -> str:
    now = int(time.time())
    payload = {"iss": claims.pop("iss", None), "sub": "carol", "aud": AUDIENCE, "iat": now, "exp": now + 300}
    return jwt.encode({**payload, **claims}, key, algorithm="RS256", headers={"kid": kid})


def test_access_tokens_from_the_provider_are_keys_and_forged_or_expired_ones_are_refused(setup):
    gw, provider = setup["gw"], setup["provider"]

    def me(token):
        return http(f"{gw.url}/v1/me", headers={"Authorization": f"Bearer {token}"})

    status, _, out = me(client_credentials_token(setup))  # the provider's own JWT access token
    assert status == 200, out
    assert (out["kind"], out["subject"], out["cache_group"]) == ("person", CLIENT_ID, "team-a")
    good = signed(provider.key, provider.kid, iss=provider.issuer, groups=["ml-admins"], email="carol@example.com")
    assert me(good)[2]["admin"] is True
    status, _, out = http(f"{gw.url}/v1/chat/completions", "POST", CHAT, {"Authorization": f"Bearer {good}"})
    assert status == 200, out

    forger, _ = rsa_jwk("test-key-1")  # the provider's kid, another key
    refusals = {
        "forged": signed(forger, provider.kid, iss=provider.issuer),
        "expired": signed(provider.key, provider.kid, iss=provider.issuer, exp=int(time.time()) - 120),
        "another audience": signed(provider.key, provider.kid, iss=provider.issuer, aud="https://elsewhere"),
        "another issuer": signed(provider.key, provider.kid, iss="https://evil.example"),
        "HS256 with the public key": jwt.encode({"sub": "x", "iss": provider.issuer, "aud": AUDIENCE}, "k" * 32),
        "not a JWT": "a.b.c",
    }
    for why, token in refusals.items():
        status, _, out = me(token)
        assert status == 401, (why, out)
        assert "access token refused" in out["error"]["message"], (why, out)
    assert "expired" in me(refusals["expired"])[2]["error"]["message"]
    assert good not in gw.log()  # tokens are never logged
    # a made-up redirect back or cookie is refused in words, never a 500
    assert http(f"{gw.url}/auth/callback?state=x&code=y")[0] == 400
    assert as_cookie(setup, "made.up")[0] == 401
