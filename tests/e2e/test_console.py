"""The web console at /ui, driven by a real headless browser (Debian's chromium through its
chromium-driver, with Selenium) against a real gateway with 50 models configured."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import yaml
from helpers import REPO, http, start_gateway
from helpers.browser import browser_missing, headless_chromium

from mlxgw.gateway.access.keys import hash_key

ADMIN = "mlxgw-console-admin-0123456789"
USER = "mlxgw-console-user-0123456789"
N_SPARE = 48  # with echo and null: 50 models
# Screenshots are saved under the test's tmp folder and copied here, which outlives pytest's
# rotation of its tmp folders (the path is printed either way).
ARTIFACTS = Path(os.environ.get("MLXGW_TEST_ARTIFACTS", REPO / "build" / "test-artifacts")) / "console"


@pytest.fixture(scope="module")
def console_gateway(home, tmp_path_factory):
    keys_path = home / "console-keys.yaml"
    keys_path.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "root", "sha256": hash_key(ADMIN), "admin": True},
                    {"name": "erin", "sha256": hash_key(USER), "tpd": 100000},
                ]
            }
        )
    )
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "echo", "engine": "echo", "preload": True, "routing": {"replicas": 2}},
            {"name": "null", "engine": "null", "preload": True},
            *({"name": f"spare-{i:02d}", "engine": "null"} for i in range(N_SPARE)),
        ],
    }
    gw = start_gateway(home, config, "console-gateway", extra_args=("--keys", str(keys_path)))
    yield gw
    gw.stop()


@pytest.fixture
def browser(tmp_path, capsys):
    missing = browser_missing()
    if missing:
        with capsys.disabled():  # said on the terminal, not only in the skip report
            print(f"\nSKIPPED browser test: {missing}")
        pytest.skip(missing)
    driver = headless_chromium(tmp_path / "chromium-profile", 60, performance_log=True)
    yield driver
    driver.quit()


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(path, ARTIFACTS / name))


def wait_until(driver, condition, timeout: float = 30, what: str = "condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d), f"timed out: {what}")


def requested_urls(driver, page_origin: str) -> list[str]:
    """Every URL the browser requested for documents of page_origin (the browser's own
    chrome:// pages, such as the first blank tab, are not the console's doing)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            params = message["params"]
            if params.get("documentURL", "").startswith(page_origin):
                urls.append(params["request"]["url"])
    return urls


def sign_in(driver, gw) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{gw.url}/ui")
    wait_until(driver, lambda d: d.find_element(By.ID, "login-key").is_displayed(), what="the sign-in form")
    driver.find_element(By.ID, "login-key").send_keys(ADMIN)
    driver.find_element(By.ID, "login-submit").click()
    wait_until(driver, lambda d: d.find_element(By.ID, "app").is_displayed(), what="the console after sign-in")


def model_state(driver, name: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f"tr[data-model='{name}'] .pill").text


def test_console_shows_models_unloads_one_and_streams_a_playground_reply(console_gateway, browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    gw = console_gateway
    for _ in range(3):  # some history for the recent-requests table and the usage tab
        body = {"model": "null", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        assert http(f"{gw.url}/v1/chat/completions", "POST", body, {"Authorization": f"Bearer {USER}"})[0] == 200
    driver = browser
    sign_in(driver, gw)

    rows = wait_until(
        driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#models-table tbody tr")) == 50 and d, what="50 rows"
    )
    assert rows
    wait_until(driver, lambda d: model_state(d, "null").startswith("ready"), what="null ready")
    # a model with replicas: one line per replica under its name (load, cache, hits, routing)
    replicas = "tr[data-model='echo'] .replica"
    wait_until(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, replicas)) == 2, what="echo's replicas")
    lines = [r.text for r in driver.find_elements(By.CSS_SELECTOR, replicas)]
    assert all("routed" in line and "cold warm turns" in line for line in lines), lines
    wait_until(driver, lambda d: "erin" in d.find_element(By.ID, "recent-table").text, what="recent requests")

    status = http(f"{gw.url}/v1/status", headers={"Authorization": f"Bearer {ADMIN}"})[2]
    pid = next(m for m in status["models"] if m["name"] == "null")["workers"][0]["pid"]
    assert psutil.pid_exists(pid)
    driver.find_element(By.CSS_SELECTOR, "button[data-action='unload'][data-model='null']").click()
    wait_until(driver, lambda d: not _alive(pid), timeout=60, what="the null worker process to end")
    wait_until(driver, lambda d: model_state(d, "null") == "unloaded", what="null shown unloaded")
    shots = [screenshot(driver, tmp_path, "console-overview.png")]

    driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='keys']").click()
    wait_until(driver, lambda d: "erin" in d.find_element(By.ID, "usage-table").text, what="usage per key")
    shots.append(screenshot(driver, tmp_path, "console-keys.png"))

    driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='playground']").click()
    Select(driver.find_element(By.ID, "play-model")).select_by_value("echo")
    box = driver.find_element(By.ID, "play-input")
    box.send_keys("Hello from the console playground")
    box.send_keys(Keys.ENTER)
    wait_until(
        driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".bubble.assistant[data-done='1']"), what="the reply to end"
    )
    reply = driver.find_element(By.CSS_SELECTOR, ".bubble.assistant .bubble-text").text
    assert reply == "Hello from the console playground"  # the echo engine repeats the message
    shots.append(screenshot(driver, tmp_path, "console-playground.png"))
    with capsys.disabled():
        print(f"\nconsole screenshots (also under {tmp_path}): {', '.join(map(str, shots))}")

    urls = requested_urls(driver, gw.url)
    origin = urlsplit(gw.url)
    assert any(u.endswith("/v1/chat/completions") for u in urls) and any(u.endswith("/console.js") for u in urls)
    foreign = [u for u in urls if not u.startswith("data:") and urlsplit(u)[:2] != origin[:2]]
    assert foreign == [], f"the console requested other origins: {foreign}"


def test_console_creates_and_revokes_a_key(console_gateway, browser):
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, console_gateway)
    driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='keys']").click()
    driver.find_element(By.ID, "key-name").send_keys("frank")
    driver.find_element(By.ID, "key-tpd").send_keys("5000")
    driver.find_element(By.ID, "key-cache-group").send_keys("team-a")
    driver.find_element(By.ID, "key-create").click()
    wait_until(driver, lambda d: d.find_element(By.ID, "new-key").is_displayed(), what="the new key")
    key = driver.find_element(By.ID, "new-key-value").text
    assert key.startswith("mlxgw-")
    body = {"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"Authorization": f"Bearer {key}"}
    assert http(f"{console_gateway.url}/v1/chat/completions", "POST", body, auth)[0] == 200

    revoke = "button[data-action='revoke'][data-key='frank']"
    wait_until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, revoke), what="frank in the key table")
    assert "cache group team-a" in driver.find_element(By.ID, "keys-table").text  # shares its cache hits
    driver.find_element(By.CSS_SELECTOR, revoke).click()
    driver.find_element(By.CSS_SELECTOR, revoke).click()  # the second click confirms
    wait_until(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, revoke), what="frank gone from the table")
    assert http(f"{console_gateway.url}/v1/chat/completions", "POST", body, auth)[0] == 401


def test_console_lists_every_keys_batch_jobs(console_gateway, browser):
    """A batch made by a non-admin key shows in the admin's console with its owner."""
    import io

    import openai
    from selenium.webdriver.common.by import By

    erin = openai.OpenAI(base_url=f"{console_gateway.url}/v1", api_key=USER, max_retries=0)
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    upload = io.BytesIO((json.dumps(line) + "\n").encode())
    upload.name = "in.jsonl"
    batch = erin.batches.create(
        input_file_id=erin.files.create(file=upload, purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    driver = browser
    sign_in(driver, console_gateway)
    driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='keys']").click()
    wait_until(
        driver,
        lambda d: any(
            "erin" in row.text and batch.id[:12] in row.text
            for row in d.find_elements(By.CSS_SELECTOR, "#batches-table tbody tr")
        ),
        what="erin's batch in the batch table",
    )


def test_a_non_admin_key_cannot_sign_in(console_gateway, browser):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{console_gateway.url}/ui/")
    wait_until(driver, lambda d: d.find_element(By.ID, "login-key").is_displayed(), what="the sign-in form")
    driver.find_element(By.ID, "login-key").send_keys(USER)
    driver.find_element(By.ID, "login-submit").click()
    wait_until(driver, lambda d: "not an admin key" in d.find_element(By.ID, "login-error").text, what="refusal")
    assert not driver.find_element(By.ID, "app").is_displayed()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_console_files_are_public_but_fixed_and_same_origin_only(console_gateway):
    status, headers, body = http(f"{console_gateway.url}/ui/")
    assert status == 200 and "<title>mlxgw console</title>" in body
    assert "default-src 'none'" in headers["content-security-policy"]
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert "http" not in body.replace(console_gateway.url, "").split("<body>")[0].replace("http-equiv", "")
    assert http(f"{console_gateway.url}/ui/..%2Fkeys.py")[0] == 404
    assert http(f"{console_gateway.url}/ui/missing.js")[0] == 404
    # Everything the page shows comes from admin routes, which need a key.
    assert http(f"{console_gateway.url}/v1/status/requests")[0] == 401
    assert http(f"{console_gateway.url}/v1/status/requests", headers={"Authorization": f"Bearer {USER}"})[0] == 403


def test_console_keeps_updating_while_the_gateway_is_under_load(console_gateway, browser):
    import asyncio
    import threading

    from selenium.webdriver.common.by import By

    from mlxgw.bench.loadgen import run_level, varied_prompts

    gw = console_gateway
    driver = browser
    sign_in(driver, gw)
    outcome = {"failed": 0, "done": 0}
    stop = threading.Event()

    def load() -> None:  # 32 clients, batch after batch, until the check is over
        while not stop.is_set():
            prompts = varied_prompts(256, 20, seed=outcome["done"])
            results, _ = asyncio.run(
                run_level(f"{gw.url}/v1", "echo", prompts, 32, max_tokens=16, temperature=0.0, api_key=ADMIN)
            )
            outcome["failed"] += sum(1 for r in results if not r.ok)
            outcome["done"] += len(results)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        seen = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(seen) < 4:
            # Read in one script: the table is redrawn every poll, so element handles go stale.
            first = driver.execute_script(
                "const r = document.querySelector('#recent-table tbody tr'); return r ? r.textContent : '';"
            )
            if first:
                seen.add(first)
            time.sleep(0.5)
        assert len(seen) >= 4, "the recent-requests table stopped updating under load"
        assert "unreachable" not in driver.find_element(By.ID, "conn-text").text
    finally:
        stop.set()
        loader.join(300)
    assert outcome["done"] >= 256 and outcome["failed"] == 0


def test_with_keys_off_on_loopback_the_console_opens_without_a_sign_in(tiny_gateway, browser):
    """The quick start runs without keys: the console must not show a sign-in nothing can pass."""
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{tiny_gateway.url}/ui")
    wait_until(driver, lambda d: d.find_element(By.ID, "app").is_displayed(), what="the console, no sign-in")
    assert not driver.find_element(By.ID, "login").is_displayed()
    wait_until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-model='tiny']"), what="the models table")


def test_with_keys_on_the_sign_in_says_how_to_create_an_admin_key(console_gateway, browser):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{console_gateway.url}/ui")
    wait_until(driver, lambda d: d.find_element(By.ID, "login-key").is_displayed(), what="the sign-in form")
    assert "mlxgw keys create NAME --admin" in driver.find_element(By.ID, "login").text
    assert driver.find_element(By.ID, "login-error").text == ""  # nothing was typed: nothing refused
