"""One route table (gateway/web/routes.py): every route the app serves has exactly one entry,
the entries agree with the rules for paths no route matches, and the middlewares really
enforce what each entry says, checked over real HTTP for every route against a gateway
with keys: no key is a 401, a user key on an admin route a 403, each in the route's API
error shape, and public routes answer without a key."""

from __future__ import annotations

import re

import pytest
import yaml
from aiohttp import web
from helpers import http, start_gateway

from mlxgw.gateway.access.keys import hash_key
from mlxgw.gateway.app import route_tables, unlisted_routes
from mlxgw.gateway.web.routes import ROUTE_FOR_KIND, ROUTES, Access, Family, family_of, lookup
from mlxgw.shared.model_sections import KINDS

KEYS = {"user": "mlxgw-routes-user-key-0123456789", "root": "mlxgw-routes-admin-key-0123456789"}


def _app_routes() -> set[tuple[str, str]]:
    app = web.Application()
    for table in route_tables():
        app.add_routes(table)
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def test_every_app_route_has_an_entry():
    app = web.Application()
    for table in route_tables():
        app.add_routes(table)
    assert unlisted_routes(app) == [], "add these routes to gateway/web/routes.py"


def test_every_entry_is_an_app_route():
    served = _app_routes()
    stale = [(m, r.path) for r in ROUTES for m in r.methods if (m, r.path) not in served]
    assert stale == [], "entries in gateway/web/routes.py with no route behind them"


def test_each_route_is_listed_once():
    pairs = [(m, r.path) for r in ROUTES for m in r.methods]
    assert len(pairs) == len(set(pairs))


def test_an_unmatched_path_gets_the_error_shape_its_neighbours_have():
    for route in ROUTES:
        assert family_of(route.path) == route.family, route.path


def test_every_model_kind_names_the_route_that_serves_it():
    assert set(ROUTE_FOR_KIND) == set(KINDS)
    for path in ROUTE_FOR_KIND.values():
        assert lookup("POST", path) is not None, path


def test_usage_rows_are_api_calls_only():
    for route in ROUTES:
        if route.usage is not None:
            # POST, and Ollama's DELETE /api/delete (a change the operator's ledger records)
            assert route.methods in (("POST",), ("DELETE",)), route.path
            assert route.access in (Access.KEY, Access.ADMIN, Access.MANAGE), route.path


@pytest.fixture(scope="module")
def keyed_gateway(tmp_path_factory):
    home = tmp_path_factory.mktemp("routes-home")
    keys = [{"name": "user", "sha256": hash_key(KEYS["user"])}]
    keys.append({"name": "root", "sha256": hash_key(KEYS["root"]), "admin": True})
    (home / "keys.yaml").write_text(yaml.safe_dump({"keys": keys}))
    config = {"manager": {"auto_discover": False}, "models": [{"name": "null", "engine": "null"}]}
    gw = start_gateway(home, config, "routes-gateway", extra_args=("--keys", str(home / "keys.yaml")))
    yield gw
    gw.stop()


def _url(gw, path: str) -> str:
    return gw.url + re.sub(r"\{[^}]+\}", "x", path)


def _error_message(family: Family, body) -> str:
    """The message of an error body in the family's shape (a KeyError/TypeError if not)."""
    if family is Family.ANTHROPIC:
        assert body["type"] == "error"
        return body["error"]["message"]
    if family is Family.OLLAMA:
        assert isinstance(body["error"], str)
        return body["error"]
    return body["error"]["message"]


CALLS = [(m, r) for r in ROUTES for m in r.methods]


@pytest.mark.parametrize("method,route", CALLS, ids=[f"{m} {r.path}" for m, r in CALLS])
def test_the_middlewares_enforce_each_entry(keyed_gateway, method, route):
    url = _url(keyed_gateway, route.path)
    body = {} if method in ("POST", "PATCH") else None
    status, _, out = http(url, method, body)
    if route.access is Access.PUBLIC:
        assert status not in (401, 403), (status, out)
        return
    assert status == 401, (status, out)
    assert "API key" in _error_message(route.family, out)
    status, _, out = http(url, method, body, {"Authorization": f"Bearer {KEYS['user']}"})
    if route.access in (Access.ADMIN, Access.OBSERVER, Access.MANAGE):
        assert status == 403, (status, out)
        assert "admin" in _error_message(route.family, out)
    elif route.access is Access.PERSON:  # a key is not a signed-in person, not even an admin's
        assert status == 403, (status, out)
        assert "signed-in person" in _error_message(route.family, out)
    else:
        assert status not in (401, 403), (status, out)


@pytest.mark.parametrize("path,family", [("/v1/messages/nope", Family.ANTHROPIC), ("/api/nope", Family.OLLAMA)])
def test_a_path_no_route_matches_answers_in_its_apis_shape(keyed_gateway, path, family):
    status, _, out = http(keyed_gateway.url + path, "POST", {}, {"Authorization": f"Bearer {KEYS['user']}"})
    assert status in (404, 405) and _error_message(family, out), (status, out)
