"""Ollama's model routes and embeddings: GET /api/tags, GET /api/ps, POST /api/show,
GET /api/version, POST /api/embed and the older POST /api/embeddings.

Details (family, context length, chat template) come from the model's own files in the
models directory (config.json, tokenizer_config.json); never from a path a client names."""

from __future__ import annotations

import array
import hashlib
import json
import math
import time
from pathlib import Path

from aiohttp import web

from ....shared import protocol as p
from ....shared.adapter_folder import weights_file
from ....shared.errors import invalid
from ....shared.fim import FimFormat
from ....shared.model_sections import CHAT_KINDS, ENCODER_KINDS, ModelKind
from ...access.auth import may_use
from ...models import adapters
from ...models.model_report import describe_slot
from ...pipeline.fim_support import capabilities, fim_format
from ...pipeline.serving import generation
from ...web.state import MANAGER, SETTINGS
from . import common as oc
from .fields import OllamaBody, OllamaEmbedBody
from .modelfile import parameter_lines, render_modelfile

routes = web.RouteTableDef()

# The Ollama API version reported to clients that check it (the shapes here follow it).
OLLAMA_VERSION = "0.12.0"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _model_dir(request: web.Request, slot) -> Path:
    return slot.entry.model_path(request.app[MANAGER].registry.models_dir)


def _details(config: dict, slot) -> dict:
    family = str(config.get("model_type") or slot.entry.engine)
    quant = config.get("quantization") or {}
    return {
        "parent_model": "",
        "format": "safetensors" if slot.entry.engine == "mlx" else slot.entry.engine,
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": f"{quant['bits']}-bit" if isinstance(quant, dict) and quant.get("bits") else "",
    }


def _listing(request: web.Request, slot) -> dict:
    path = _model_dir(request, slot)
    files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else []
    modified = max((f.stat().st_mtime for f in files), default=time.time())
    return {
        "name": slot.name,
        "model": slot.name,
        "modified_at": oc.created_at(modified),
        "size": sum(f.stat().st_size for f in files),
        "digest": hashlib.sha256(slot.name.encode()).hexdigest(),
        "details": _details(_read_json(path / "config.json"), slot),
    }


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    listing = [_listing(request, s) for s in manager.slots.values() if may_use(request, s)]
    listing += [_adapter_listing(request, s, a) for s, a in adapters.listed(manager, request.get("key"))]
    return web.json_response({"models": listing})


def _adapter_listing(request: web.Request, slot, adapter) -> dict:
    """A LoRA adapter as Ollama lists a model derived from another: its base as parent_model."""
    base = _listing(request, slot)
    try:
        st = weights_file(adapter.folder()).stat()
        size, modified = st.st_size, st.st_mtime
    except OSError:  # a folder that is gone: listed still, its requests say why
        size, modified = 0, time.time()
    return {
        **base,
        "name": adapter.name,
        "model": adapter.name,
        "modified_at": oc.created_at(modified),
        "size": size,
        "digest": hashlib.sha256(adapter.name.encode()).hexdigest(),
        "details": {**base["details"], "parent_model": slot.name},
    }


def _expires_at(manager, slot) -> str:
    """When the model leaves if nothing uses it: keep_alive, else the idle-unload policy."""
    now = time.monotonic()
    idle = slot.entry.idle_unload_s
    idle = manager.registry.manager.idle_unload_s if idle is None else idle
    until = max(slot.keep_until, slot.last_used + idle if idle and not slot.entry.pin else math.inf)
    wall = time.time() + min(until - now, 10 * 365 * 86400)  # "forever" as ten years, as a date
    return oc.created_at(wall)


@routes.get("/api/ps")
async def ps(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    running = []
    for slot in manager.slots.values():
        d = describe_slot(manager, slot)
        if not d["loaded"] or not may_use(request, slot):
            continue
        context = next((w["context_length"] for w in d["workers"] if w["context_length"]), None)
        running.append(
            {
                **_listing(request, slot),
                "size": d["memory_bytes"] or d["expected_bytes"],
                "size_vram": 0,
                "expires_at": _expires_at(manager, slot),
                "context_length": context,
            }
        )
    return web.json_response({"models": running})


def _template(chat_template: object, fim: FimFormat | None) -> str:
    """A FIM model's template is Ollama's Go template with `.Suffix` (Continue's Ollama
    provider offers server-side FIM only when it finds `.Suffix` in it); another model's is
    its chat template, for clients that show it."""
    if fim is None:
        return chat_template if isinstance(chat_template, str) else ""
    if fim.order == "spm":
        hole = f"{fim.suffix}{{{{ .Suffix }}}}{fim.prefix}{{{{ .Prompt }}}}{fim.middle or ''}"
    else:
        hole = f"{fim.prefix}{{{{ .Prompt }}}}{fim.suffix}{{{{ .Suffix }}}}{fim.middle or ''}"
    return f"{{{{- if .Suffix }}}}{hole}{{{{- else }}}}{{{{ .Prompt }}}}{{{{- end }}}}"


def _model_info(family: str, config: dict, context: int | None) -> dict:
    """Ollama's model_info keys, from config.json."""
    info: dict = {"general.architecture": family}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key, name in (
        ("context_length", None),
        ("embedding_length", "hidden_size"),
        ("block_count", "num_hidden_layers"),
        ("attention.head_count", "num_attention_heads"),
        ("attention.head_count_kv", "num_key_value_heads"),
        ("vocab_size", "vocab_size"),
    ):
        value = context if name is None else text.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            info[f"{family}.{key}"] = value
    return info


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    _, slot = await oc.open_request(request, OllamaBody, kinds=(*CHAT_KINDS, *ENCODER_KINDS))
    entry = slot.entry
    path = _model_dir(request, slot)
    config = _read_json(path / "config.json")
    template = entry.chat.chat_template or _read_json(path / "tokenizer_config.json").get("chat_template")
    details = {**_details(config, slot), "parent_model": entry.parent or ""}
    context = entry.context_length or config.get("max_position_embeddings")
    info = _model_info(details["family"], config, context)
    fim = fim_format(request, slot)
    # Ollama's Modelfile parameter lines; Continue parses each as `key value`.
    parameters = parameter_lines(entry)
    if entry.context_length is None and isinstance(context, int):
        parameters.append(f"num_ctx {context}")
    shown = {
        # What /api/create was given, as Ollama returns it (`ollama show --modelfile`, Open
        # WebUI's model editor): FROM the parent, else the folder the model is served from.
        "modelfile": render_modelfile(entry, str(path)),
        "parameters": "\n".join(parameters),
        "template": _template(template, fim),
        "details": details,
        "model_info": info,
        "capabilities": capabilities(slot, fim),
        "modified_at": _listing(request, slot)["modified_at"],
    }
    if entry.chat.system is not None:
        shown["system"] = entry.chat.system
    if entry.chat.messages:
        shown["messages"] = [{"role": m.role, "content": m.content} for m in entry.chat.messages]
    return web.json_response(shown)


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


# -- embeddings -----------------------------------------------------------------------------------


def _inputs(raw, name: str) -> list[str]:
    if isinstance(raw, str) and raw:
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(x, str) and x for x in raw):
        return raw
    raise invalid(f"'{name}' must be a non-empty string or a list of non-empty strings", name)


async def _embed(request: web.Request, slot, f: OllamaEmbedBody, inputs: list[str]) -> tuple[list[list[float]], dict]:
    oc.parse_options(f)  # checked like every API's options, though an encoder samples nothing
    req = p.EmbedRequest(
        rid=request["rid"],
        inputs=inputs,
        dimensions=f.dimensions,
        timeout_s=request.app[SETTINGS].request_timeout_s,
    )
    async with generation(request, slot, req) as gen:
        done = await gen.finish_event()
    blob, dim = done.vectors, int(done.dim)
    row = dim * 4
    vectors = [array.array("f", blob[i * row : (i + 1) * row]).tolist() for i in range(len(inputs))]
    return vectors, oc.timings(gen, gen.usage)


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    f, slot = await oc.open_request(request, OllamaEmbedBody, kinds=(ModelKind.EMBEDDING,))
    keep_alive = oc.parse_duration(f.keep_alive)
    inputs = _inputs(f.input, "input")
    try:
        vectors, timing = await _embed(request, slot, f, inputs)
    finally:
        oc.apply_keep_alive(request, slot, keep_alive)
    counters = {k: timing[k] for k in ("total_duration", "load_duration", "prompt_eval_count")}
    return web.json_response({"model": slot.name, "embeddings": vectors, **counters})


@routes.post("/api/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """The older single-prompt form: {"model", "prompt"} -> {"embedding": [...]}."""
    f, slot = await oc.open_request(request, OllamaEmbedBody, kinds=(ModelKind.EMBEDDING,))
    keep_alive = oc.parse_duration(f.keep_alive)
    inputs = _inputs(f.prompt, "prompt")
    try:
        vectors, _ = await _embed(request, slot, f, inputs)
    finally:
        oc.apply_keep_alive(request, slot, keep_alive)
    return web.json_response({"embedding": vectors[0]})
