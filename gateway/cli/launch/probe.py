"""The facts a launch configures a client from, asked of the running gateway: is it up, which
model (the alias table decides what the client's own names reach), its context and measured
prefill rate, and the key to send (given, stored from an earlier launch, or created)."""

from __future__ import annotations

import getpass
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from ....shared import paths
from .core import DEFAULT_CONTEXT, LaunchError, ServerFacts

DEFAULT_PORT = 8000
NEW_KEY = "<new key>"  # --print: the key a launch would create
CREATED = "created key"  # the note of a launch that made its key
TIMEOUT_S = 10


def local_url() -> str:
    """The gateway on this machine, found as `mlxgw reload` finds one: a live gateway's pid
    file (port 8000 first), else the default port."""
    from ...runfiles import is_gateway

    ports = []
    for pid_file in sorted(paths.run_dir().glob("gateway-*.pid")):
        try:
            port, pid = int(pid_file.stem.split("-", 1)[1]), int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if is_gateway(pid):
            ports.append(port)
    port = DEFAULT_PORT if DEFAULT_PORT in ports or not ports else ports[0]
    return f"http://127.0.0.1:{port}"


def http_json(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body); status 0 when nothing answers."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def check_up(url: str) -> None:
    status, _ = http_json(f"{url}/health")
    if status == 0:
        raise LaunchError(f"no mlxgw gateway answers at {url}: start one with `mlxgw up` (or pass --url)")


# -- the key --------------------------------------------------------------------------------------
def _stored_key_path() -> Path:
    return paths.home() / "launch-key"


def _key_status(url: str, key: str) -> int:
    """HTTP status of /v1/models for the key: 401 means the gateway does not know it."""
    return http_json(f"{url}/v1/models", key)[0]


def _usable(url: str, key: str, what: str) -> bool:
    """The gateway knows the key (any answer but 401: a 429 is a known key, rate limited);
    no answer at all or a server error is an error here, never a reason to make a key."""
    status = _key_status(url, key)
    if status == 0 or status >= 500:
        raise LaunchError(f"could not check {what} with the gateway at {url} (HTTP {status}); try again")
    return status != 401


def _is_local(url: str) -> bool:
    host = urllib.request.urlparse(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def pick_key(url: str, given: str | None, *, create: bool) -> tuple[str | None, str | None, str]:
    """(key, its name for messages, a note). Keys off: (None, None, ...). Keys on: the given key,
    else the one an earlier launch stored in $MLXGW_HOME/launch-key, else (local gateway with
    the default keys file) a new key named launch-USER, stored there (owner-only). A key is
    never revoked, replaced or made again by name: a stored key the gateway refuses was revoked
    (or expired), and stays so."""
    status, _ = http_json(f"{url}/v1/models")
    if status != 401:
        if given:
            return given, "given", "the gateway runs without keys; the given key is sent anyway"
        return None, None, "the gateway runs without keys"
    if given:
        if not _usable(url, given, "the given key"):
            raise LaunchError(f"the gateway at {url} refuses the given key")
        return given, "given", "using the given key"
    stored = _stored_key_path()
    if stored.exists():
        key = stored.read_text().strip()
        if key and _usable(url, key, f"the key stored in {stored}"):
            return key, f"stored in {stored}", f"reusing the key stored in {stored}"
        raise LaunchError(
            f"the gateway at {url} refuses the key stored in {stored} (revoked or expired): ask the "
            "operator for a key and pass it with --key (or MLXGW_API_KEY); launch does not make it again"
        )
    keys_file = paths.keys_file()
    if not _is_local(url) or not keys_file.exists():
        raise LaunchError(
            f"the gateway at {url} needs a key: pass --key KEY (or set MLXGW_API_KEY); "
            "an operator creates one with `mlxgw keys create NAME`"
        )
    name = f"launch-{getpass.getuser()}"
    if not create:
        return NEW_KEY, name, f"would create key {name!r} in {keys_file} and store it in {stored}"
    return _create_key(keys_file, name, stored), name, f"{CREATED} {name!r}; stored in {stored}"


def _create_key(keys_file: Path, name: str, stored: Path) -> str:
    """A key with no admin or model-management rights (limited to the launched model once it
    is known: limit_key); a name already in the keys file is the operator's, never replaced."""
    from ...access.audit import record_local
    from ...access.key_admin import KeyEditError, create_key

    try:
        key, _ = create_key(keys_file, name, {})
    except KeyEditError as e:
        record_local("keys.create", name, reason=str(e), via="launch")
        if e.kind == "exists":
            raise LaunchError(
                f"a key named {name!r} is in {keys_file} but its key is not stored in {stored}: launch "
                "never replaces a key; pass it with --key, or ask the operator for one"
            ) from None
        raise LaunchError(f"cannot create a key in {keys_file}: {e}") from None
    record_local("keys.create", name, via="launch")
    stored.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(stored, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def limit_key(name: str, model: str) -> None:
    """The key launch just made may use only the model it launches with."""
    from ...access.audit import record_local
    from ...access.key_admin import KeyEditError, update_key

    try:
        update_key(paths.keys_file(), name, {"models": [model]})
    except KeyEditError as e:
        record_local("keys.update", name, {"models": [model]}, reason=str(e), via="launch")
        raise LaunchError(f"cannot limit key {name!r} to model {model!r}: {e}") from None
    record_local("keys.update", name, {"models": [model]}, via="launch")


# -- the model ------------------------------------------------------------------------------------
def pick_model(url: str, key: str | None, wanted: str | None, client_names: tuple[str, ...]) -> str:
    """--model (resolved through the alias table), else what the client's own default names
    reach (claude-*, gpt-* aliases), else the first chat model."""
    for name in [wanted] if wanted else list(client_names):
        status, body = http_json(f"{url}/v1/models/{name}", key)
        if status == 200 and body.get("kind") in ("chat", "vision", None):
            return body["id"]
        if wanted:
            why = (body.get("error") or {}).get("message") or f"HTTP {status}"
            raise LaunchError(f"model {wanted!r}: {why}")
    status, body = http_json(f"{url}/v1/models?kind=chat", key)
    models = [m for m in body.get("data") or [] if m.get("state") != "unavailable"]
    if not models:
        raise LaunchError(f"the gateway at {url} serves no chat model (HTTP {status}); add one to models.yaml")
    ready = [m for m in models if m.get("loaded")]
    return (ready or models)[0]["id"]


def model_context(url: str, key: str | None, model: str) -> tuple[int, float | None]:
    """(context length, measured prefill tokens/s or None) from the worker's status when this
    key may read it, else from /api/show's model_info; the default when neither says."""
    status, body = http_json(f"{url}/v1/status", key)
    if status == 200:
        for m in body.get("models") or []:
            if m.get("name") != model:
                continue
            workers = m.get("workers") or []
            contexts = [w.get("context_length") for w in workers if w.get("context_length")]
            rates = [(w.get("stats") or {}).get("prefill_tokens_per_s") for w in workers]
            rates = [r for r in rates if r]
            if contexts:
                return int(contexts[0]), (min(rates) if rates else None)
    status, body = http_json(f"{url}/api/show", key, {"model": model})
    info = body.get("model_info") or {} if status == 200 else {}
    for name, value in info.items():
        if name.endswith(".context_length") and isinstance(value, int) and value > 0:
            return value, None
    return DEFAULT_CONTEXT, None


def gather(
    url: str | None, model: str | None, key: str | None, client_names: tuple[str, ...], *, create_key: bool
) -> tuple[ServerFacts, str]:
    """The server facts and a note on the key."""
    base = (url or local_url()).rstrip("/")
    check_up(base)
    key, key_name, note = pick_key(base, key or os.environ.get("MLXGW_API_KEY") or None, create=create_key)
    created = note.startswith(CREATED)
    if key == NEW_KEY:  # --print before the first launch: without a key the server tells nothing
        note += "; the model and its context are asked of the server once the key exists"
        return ServerFacts(base, model or client_names[0], DEFAULT_CONTEXT, None, key, key_name), note
    served = pick_model(base, key, model, client_names)
    if created:
        limit_key(key_name, served)
    context, rate = model_context(base, key, served)
    return ServerFacts(base, served, context, rate, key, key_name), note
