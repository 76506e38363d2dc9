"""Open WebUI's admin model screens against mlxgw's Ollama API, for real: Open WebUI (its own
virtualenv; `make test-openwebui` installs it, opt-in) runs on 127.0.0.1 with its Ollama
connection at a real `mlxgw up` (echo engine, keys on, the admin key as the connection's bearer
key), and headless chromium drives its Admin Settings > Models screens with Selenium.

What Open WebUI 0.12 calls (backend/open_webui/routers/ollama.py and the built frontend):
  - the model list (Admin Settings > Models, the Manage Models dialog's delete list):
    /ollama/api/tags -> mlxgw's GET /api/tags (and GET /api/ps for expiry times)
  - Manage Models > "Pull a model from Ollama.com": /ollama/api/pull/{idx} -> POST /api/pull
  - Manage Models > "Create a model" (a name and a JSON body): /ollama/api/create/{idx} -> POST /api/create
  - Manage Models > "Delete a model": /ollama/api/delete/{idx} -> DELETE /api/delete
  - copy has no screen in 0.12; its backend route /ollama/api/copy -> POST /api/copy is
    driven here with the admin's session.
Each step is checked in mlxgw itself: its /api/tags and its models.yaml."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, http, start_gateway
from helpers.browser import browser_missing, headless_chromium
from helpers.fake_hub import hub_environment, tiny_model_hub
from helpers.openwebui import openwebui_missing, sign_up_admin, start_openwebui
from helpers.paths import FIXTURES
from helpers.recording_proxy import RecordingProxy

from mlxgw.gateway.access.key_admin import create_key

ARTIFACTS = Path(os.environ.get("MLXGW_TEST_ARTIFACTS", REPO / "build" / "test-artifacts")) / "openwebui"
# `MLXGW_RECORD_FIXTURES=1` writes Open WebUI's management requests to this fixture, which
# tests/e2e/test_ollama_manage.py replays in every CI run (CI has no Open WebUI).
RECORD = os.environ.get("MLXGW_RECORD_FIXTURES") == "1"
RECORDED = FIXTURES / "openwebui_manage_requests.json"
MANAGE_ROUTES = ("/api/pull", "/api/create", "/api/copy", "/api/delete")


def _missing() -> str | None:
    return openwebui_missing() or browser_missing()


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    missing = _missing()
    if missing:
        pytest.skip(missing)
    tiny_dir = request.getfixturevalue("tiny_dir")  # only once it is known the test runs
    root = tmp_path_factory.mktemp("openwebui")
    keys = root / "keys.yaml"
    admin, _ = create_key(keys, "admin", {"admin": True})
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "echo-agent", "engine": "echo", "preload": True},
            {"name": "echo-spare", "engine": "echo"},
        ],
    }
    # A local stand-in for the hub with one small MLX model; stopped later, so that a pull
    # then fails as it does offline.
    hub = tiny_model_hub(tiny_dir)
    try:
        with hub_environment(hub, root):
            gw = start_gateway(root, config, "openwebui-gateway", extra_args=("--keys", str(keys)))
    except BaseException:
        hub.stop()
        raise
    # Open WebUI's connection goes through a recording proxy: what it really sends is asserted
    # (and, with MLXGW_RECORD_FIXTURES=1, kept as a fixture).
    proxy = RecordingProxy(gw.url).start()
    started = time.monotonic()
    try:
        webui = start_openwebui(root, proxy.url, admin)
    except BaseException:
        proxy.stop()
        gw.stop()
        hub.stop()
        raise
    sign_up_admin(webui)
    print(f"\nOpen WebUI ready in {time.monotonic() - started:.1f} s at {webui.url}")
    yield {"gw": gw, "webui": webui, "admin": admin, "proxy": proxy, "hub": hub}
    webui.stop()
    proxy.stop()
    gw.stop()
    hub.stop()  # again, if a test stopped it: a no-op then
    ARTIFACTS.mkdir(parents=True, exist_ok=True)  # both logs outlive pytest's tmp rotation
    shutil.copy(webui.log_path, ARTIFACTS / "openwebui.log")
    shutil.copy(gw.log_path, ARTIFACTS / "gateway.log")


@pytest.fixture(scope="module")
def browser(stack, tmp_path_factory):
    driver = headless_chromium(tmp_path_factory.mktemp("chromium-profile"), 120)
    webui = stack["webui"]
    driver.get(f"{webui.url}/auth")
    driver.execute_script("localStorage.token = arguments[0]", webui.token)  # the admin's session
    yield driver
    driver.quit()


# -- mlxgw's own view ---------------------------------------------------------------------------


def mlxgw_tags(stack) -> list[str]:
    status, _, out = http(f"{stack['gw'].url}/api/tags", headers={"Authorization": f"Bearer {stack['admin']}"})
    assert status == 200, out
    return [m["model"] for m in out["models"]]


def registry_entry(stack, name: str) -> dict | None:
    data = yaml.safe_load(stack["gw"].config_path.read_text())
    return next((m for m in data["models"] if m["name"] == name), None)


# -- the browser --------------------------------------------------------------------------------


def wait_until(driver, condition, timeout: float = 60, what: str = "condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.25).until(lambda d: condition(d), f"timed out: {what}")


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def page_text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def toasts(driver) -> str:
    """The text of every toast now shown (svelte-sonner's list; stacked ones are collapsed, so
    their textContent, not their rendered text)."""
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, "[data-sonner-toast]")
    return "\n".join(" ".join((t.get_attribute("textContent") or "").split()) for t in found)


def open_manage_models(driver, webui) -> None:
    """Admin Settings > Models, then Actions > Manage: the Manage Models dialog (the Ollama
    connection's pull, delete and create forms)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{webui.url}/admin/settings/models")
    wait_until(driver, lambda d: "echo-agent" in page_text(d), what="the admin model list")
    actions = "//button[normalize-space()='Actions']"
    wait_until(driver, lambda d: d.find_element(By.XPATH, actions), what="the Actions menu").click()
    manage = "//button[normalize-space()='Manage']"
    wait_until(driver, lambda d: d.find_element(By.XPATH, manage), what="the Manage item").click()
    wait_until(driver, lambda d: pull_input(d).is_displayed(), what="the Manage Models dialog")


def pull_input(driver):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.XPATH, "//input[contains(@placeholder, 'mistral:7b')]")


def button_beside(element):
    """The button in the same row as a field (each of the dialog's forms is a row: field, button)."""
    from selenium.webdriver.common.by import By

    return element.find_element(By.XPATH, "./ancestor::div[@class='flex w-full'][1]//button")


def button_labelled(driver, label: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.XPATH, f"//button[@aria-label='{label}']")


# -- the screens --------------------------------------------------------------------------------


def test_the_admin_model_list_shows_mlxgws_models(stack, browser):
    webui = stack["webui"]
    status, out = webui.call("GET", "/ollama/api/tags")
    assert status == 200 and {"echo-agent", "echo-spare"} <= {m["model"] for m in out["models"]}, out
    open_manage_models(browser, webui)
    text = page_text(browser)
    assert "echo-agent" in text and "echo-spare" in text
    screenshot(browser, "openwebui-manage-models.png")


def pull_in_the_dialog(driver, webui, repo: str) -> None:
    open_manage_models(driver, webui)
    field = pull_input(driver)
    field.send_keys(repo)
    button_beside(field).click()


def test_pull_from_the_hub(stack, browser):
    pull_in_the_dialog(browser, stack["webui"], "org/tiny-mlx")
    wait_until(browser, lambda d: "successfully downloaded" in toasts(d), what="the pull's success toast")
    screenshot(browser, "openwebui-pulled.png")
    assert "tiny-mlx" in mlxgw_tags(stack) and registry_entry(stack, "tiny-mlx") == {"name": "tiny-mlx"}


def test_update_all_models_pulls_the_pulled_model_again(stack, browser):
    """The dialog's "Update All Models" pulls every listed model by its name: tiny-mlx again from
    org/tiny-mlx; the echo models, pulled from nowhere, are refused (Open WebUI logs those to the
    browser's console and goes on)."""
    proxy = stack["proxy"]
    before = len(proxy.requests)
    open_manage_models(browser, stack["webui"])
    button_labelled(browser, "Update All Models").click()
    wait_until(browser, lambda d: "All models are up to date" in toasts(d), what="the update's end")
    update_all = proxy.requests[before:]
    pulls = {r.body["model"]: r.status for r in update_all if r.path == "/api/pull"}
    assert pulls == {"echo-agent": 400, "echo-spare": 400, "tiny-mlx": 200}, pulls
    assert "tiny-mlx" in mlxgw_tags(stack)
    stack["update_all"] = update_all  # not in the replayed fixture: their answers depend on what was pulled


def test_pull_is_refused_offline_with_the_error_shown(stack, browser):
    stack["hub"].stop()  # nothing answers at HF_ENDPOINT any more
    pull_in_the_dialog(browser, stack["webui"], "some-org/some-model")
    wait_until(browser, lambda d: "cannot reach the hub" in toasts(d), what="the pull's error toast")
    screenshot(browser, "openwebui-pull-refused.png")
    assert "some-model" not in mlxgw_tags(stack) and registry_entry(stack, "some-model") is None


def test_create_from_a_model_and_a_system_prompt(stack, browser):
    from selenium.webdriver.common.by import By

    webui = stack["webui"]
    open_manage_models(browser, webui)
    name = browser.find_element(By.XPATH, "//input[contains(@placeholder, 'my-modelfile')]")
    name.send_keys("owui-terse")
    body = browser.find_element(By.XPATH, "//textarea[contains(@placeholder, '\"from\"')]")
    body.send_keys('{"from": "echo-agent", "system": "Answer in one word."}')
    button_labelled(browser, "Create Model").click()
    wait_until(browser, lambda d: "owui-terse" in mlxgw_tags(stack), what="owui-terse in mlxgw's /api/tags")
    screenshot(browser, "openwebui-created.png")
    created = registry_entry(stack, "owui-terse")
    assert created["chat"]["system"] == "Answer in one word." and created["engine"] == "echo", created
    # Open WebUI lists it too, once its model cache is refreshed
    status, out = webui.call("GET", "/ollama/api/tags/0")
    assert status == 200 and "owui-terse" in [m["model"] for m in out["models"]]


def test_copy_through_open_webuis_backend(stack):
    webui = stack["webui"]
    status, out = webui.call("POST", "/ollama/api/copy", {"source": "owui-terse", "destination": "owui-terse-copy"})
    assert status == 200 and out is True, out
    assert "owui-terse-copy" in mlxgw_tags(stack)
    assert registry_entry(stack, "owui-terse-copy") is not None


def test_delete_in_the_manage_models_dialog(stack, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    webui = stack["webui"]
    open_manage_models(browser, webui)
    select = browser.find_element(By.XPATH, "//select[@title='Select a model']")
    wait_until(
        browser,
        lambda d: any(o.get_attribute("value") == "owui-terse-copy" for o in Select(select).options),
        what="owui-terse-copy in the delete list",
    )
    Select(select).select_by_value("owui-terse-copy")
    button_labelled(browser, "Delete Model").click()
    confirm = wait_until(
        browser, lambda d: d.find_element(By.XPATH, "//button[normalize-space()='Confirm']"), what="the confirm dialog"
    )
    confirm.click()
    wait_until(browser, lambda d: "owui-terse-copy" not in mlxgw_tags(stack), what="owui-terse-copy gone from mlxgw")
    wait_until(browser, lambda d: "Deleted" in toasts(d), what="the Deleted toast")
    screenshot(browser, "openwebui-deleted.png")
    assert registry_entry(stack, "owui-terse-copy") is None
    assert registry_entry(stack, "owui-terse") is not None  # the copy's source stays


def test_delete_through_open_webuis_backend(stack):
    webui = stack["webui"]
    status, out = webui.call("DELETE", "/ollama/api/delete", {"model": "owui-terse"})
    assert status == 200 and out is True, out
    assert "owui-terse" not in mlxgw_tags(stack) and registry_entry(stack, "owui-terse") is None
    status, out = webui.call("DELETE", "/ollama/api/delete/0", {"model": "owui-terse"})
    assert status == 404 and "not found" in out["detail"], out  # mlxgw's error, passed on


def test_open_webui_sent_ollamas_management_requests(stack):
    """What the screens and routes above sent to mlxgw, as recorded between the two."""
    sent = [
        {"method": r.method, "path": r.path, "body": r.body, "status": r.status}
        for r in stack["proxy"].requests
        if r.path.split("?")[0] in MANAGE_ROUTES and all(r is not u for u in stack.get("update_all", ()))
    ]
    calls = [(r["method"], r["path"], r["body"].get("model") or r["body"].get("destination")) for r in sent]
    assert calls == [
        ("POST", "/api/pull", "org/tiny-mlx"),
        ("POST", "/api/pull", "some-org/some-model"),
        ("POST", "/api/create", "owui-terse"),
        ("POST", "/api/copy", "owui-terse-copy"),
        ("DELETE", "/api/delete", "owui-terse-copy"),
        ("DELETE", "/api/delete", "owui-terse"),
        ("DELETE", "/api/delete", "owui-terse"),
    ], calls
    assert [r["status"] for r in sent] == [200, 200, 200, 200, 200, 200, 404]
    # The dialog sends `name`; Open WebUI's backend adds `model` and `insecure`.
    assert sent[1]["body"] == {"name": "some-org/some-model", "model": "some-org/some-model", "insecure": True}
    if RECORD:
        RECORDED.write_text(json.dumps(sent, indent=2) + "\n")
