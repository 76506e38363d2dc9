"""What the FIM routes share on the gateway side: which models can fill in the middle (their
format, read from their own files, as /v1/models and Ollama's /api/show report it), the
internal request's `fim` map, and superseding: on the editor wire (/infill, or a request that
names its file) a keystroke's request ends the one before it from the same editor for the
same file.

The worker decides in the end (worker/text/fim.py): a model this side thinks capable but whose
tokenizer disagrees still answers with a clear 400."""

from __future__ import annotations

import hashlib
import json
import weakref
from functools import lru_cache
from pathlib import Path

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.fim import FimFormat, detect, from_config
from ...shared.model_sections import CHAT_KINDS, ENCODER_KINDS, ModelKind
from ..web.state import MANAGER

DEFAULT_FIM_MAX_TOKENS = 128  # a completion at the cursor: a few lines (models.yaml fim.max_tokens)
MAX_EXTRA_CHUNKS = 1024  # input_extra chunks per request (llama.vscode sends 16 by default)


def fim_format(request: web.Request, slot) -> FimFormat | None:
    """The model's FIM format: its models.yaml `fim:` over what its tokenizer files hold."""
    entry = slot.entry
    if entry.kind not in CHAT_KINDS or entry.engine != "mlx":
        return None
    path = entry.model_path(request.app[MANAGER].registry.models_dir)
    return from_config(entry.fim, _detected(path))


def capabilities(slot, fim: FimFormat | None) -> list[str]:
    """What a model can do, in Ollama's capability names (/api/show, /v1/models). Every chat
    model takes tools here (its template's format, or the generic one mlxgw writes into the
    messages); `insert` is fill-in-the-middle."""
    e = slot.entry
    if e.kind in ENCODER_KINDS:
        return ["embedding"]
    if e.kind not in CHAT_KINDS:
        return [e.kind.value]  # audio, speech
    caps = ["completion", "tools"]
    caps += ["insert"] if fim is not None else []
    caps += ["vision"] if e.kind == ModelKind.VISION else []
    caps += ["thinking"] if e.chat.reasoning_parser else []
    return caps


def fim_max_tokens(slot) -> int:
    return slot.entry.fim.max_tokens if slot.entry.fim is not None else DEFAULT_FIM_MAX_TOKENS


def _detected(folder: Path) -> FimFormat | None:
    stamps = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            stamps.append((name, (folder / name).stat().st_mtime_ns))
        except OSError:
            continue
    return _detect_in_files(folder, tuple(stamps))


@lru_cache(maxsize=64)
def _detect_in_files(folder: Path, stamps: tuple) -> FimFormat | None:
    """A token is in the vocabulary when its JSON string is in the tokenizer's files (one
    substring search per token, not a parse of a vocabulary of 150,000 entries)."""
    blobs = []
    for name, _ in stamps:
        try:
            blobs.append((folder / name).read_bytes())
        except OSError:
            continue

    def has(token: str) -> bool:
        spellings = {json.dumps(token).encode(), json.dumps(token, ensure_ascii=False).encode()}
        return any(s in blob for blob in blobs for s in spellings)

    return detect(has)


def fim_map(prefix: str, suffix: str, middle: str = "", extra=None, filename=None, repo=None) -> dict:
    """GenerateRequest.fim (shared/protocol.py)."""
    out: dict = {"prefix": prefix, "suffix": suffix}
    if middle:
        out["middle"] = middle
    if extra:
        out["extra"] = extra
    if filename:
        out["filename"] = filename
    if repo:
        out["repo"] = repo
    return out


def parse_extra(raw) -> list[list[str]]:
    """llama.cpp's input_extra: [{"filename": str, "text": str}, ...] as [[filename, text], ...]."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("input_extra must be a list of {filename, text} objects", "input_extra")
    if len(raw) > MAX_EXTRA_CHUNKS:
        raise invalid(f"input_extra has {len(raw)} chunks; at most {MAX_EXTRA_CHUNKS} are taken", "input_extra")
    out = []
    for i, chunk in enumerate(raw):
        if not isinstance(chunk, dict):
            raise invalid(f"input_extra[{i}] must be an object with filename and text", "input_extra")
        name, text = chunk.get("filename", ""), chunk.get("text", "")
        if not isinstance(name, str) or not isinstance(text, str):
            raise invalid(f"input_extra[{i}].filename and .text must be strings", "input_extra")
        out.append([name, text])
    return out


# -- superseding --------------------------------------------------------------------------------


def file_identity(prefix: str, suffix: str, filename: str | None = None) -> str:
    """Which file a keystroke's request is for, from what stays put while one types: the
    file's name when the client sends one, else the first line of the prefix and the last
    line of the suffix (typing changes the lines at the cursor, not the ends of the window)."""
    if filename:
        return "name:" + filename
    first = prefix.split("\n", 1)[0] if "\n" in prefix else ""
    last = suffix.rsplit("\n", 1)[-1] if "\n" in suffix else ""
    return hashlib.sha256(f"{first}\0{last}".encode()).hexdigest()[:32]


class Superseding:
    """The FIM request in flight per (key, client address, model, file), for the editor wire
    only (serving.ApiFamily.respond). A newer one ends the older at once with an explicit
    error (its API's JSON, or its stream's error event): its request is cancelled in the worker
    (gateway/models/generation.py), so no token is decoded for a keystroke already typed over,
    and its client is answered, never left with a reset connection."""

    def __init__(self) -> None:
        self._latest: dict[tuple, web.Request] = {}

    def claim(self, request: web.Request, model: str, identity: str):
        """End the older request for the same file; returns the release to call when done."""
        key = request.get("key")
        slot_key = (key.name if key is not None else None, request.remote, model, identity)
        older = self._latest.get(slot_key)
        if older is not None and older is not request:
            _supersede(older)
        self._latest[slot_key] = request

        def release() -> None:
            if self._latest.get(slot_key) is request:
                del self._latest[slot_key]

        return release

    def __len__(self) -> int:
        return len(self._latest)


SUPERSEDED = "superseded by a newer request for the same file from this client"


def _supersede(request: web.Request) -> None:
    err = ServiceError(ErrorCode.CANCELLED, SUPERSEDED)
    request["superseded"] = err  # a generation made after this ends at once (serving.generation)
    gen = request.get("generation")
    if gen is not None:
        gen.end_with(err)


_SUPERSEDING: weakref.WeakKeyDictionary[web.Application, Superseding] = weakref.WeakKeyDictionary()


def superseding(app: web.Application) -> Superseding:
    found = _SUPERSEDING.get(app)
    if found is None:
        found = _SUPERSEDING[app] = Superseding()
    return found
