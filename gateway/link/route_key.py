"""What the pool routes a request by: chains of hashes over its prompt's leading parts.

The gateway does not tokenize (the worker's template and tokenizer make the tokens), so the
pool cannot name the worker's KV blocks. It hashes what it has instead: each message of a
chat (or each 1 KiB of a text prompt, each 256 tokens of a token prompt) extends a hash chain
that starts from the cache namespace, the adapter, the tools and the template's arguments.
Two requests share a chain entry exactly when their prompts agree up to that point, which is
when the worker's prefix cache can serve one from the other: turn N+1 of a session repeats
turn N's messages and adds to them. The namespace is in the first link, so no chain entry is
shared across cache namespaces and no routing decision crosses them either."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack

from ...shared import protocol as p

TEXT_CHUNK = 1024  # characters of a text prompt per chain link
TOKEN_CHUNK = 256  # tokens of a token prompt per chain link
# Chain entries a request carries to its worker (the deepest ones past the shared head): what
# the worker reports holding and evicting. A session's next turn matches its last turn's
# last entry, so the tail is what routing needs; 64 bounds the request's size (1 KiB).
REPORTED_ENTRIES = 64
LEADING_ROLES = ("system", "developer")


@dataclass(frozen=True)
class RouteKey:
    chain: tuple[bytes, ...]  # one entry per message (or chunk), each covering all before it
    # The entries before lead are the head many sessions share (tools, system prompt): a
    # match that short says nothing about where a session lives.
    lead: int
    # Where a session lives when no replica holds its prefix: rendezvous hashing of this over
    # the replicas, so a session's turns meet on one replica with no state (a gateway restart
    # included). The client's session id when it sends one, else the session's first turn.
    anchor: bytes
    session: str | None = None  # (namespace-qualified) session id the client sent


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _pack(value) -> bytes:
    try:
        return msgpack.packb(value, default=repr)
    except (TypeError, ValueError, OverflowError):
        return repr(value).encode("utf-8", "replace")


def route_key(req: p.WorkerRequest, session: str | None = None) -> RouteKey | None:
    """The request's chain, or None for requests with no prompt to reuse (embeddings, audio)."""
    if not isinstance(req, p.GenerateRequest):
        return None
    namespace = req.cache_namespace or ""
    seed = _digest(namespace.encode(), (req.adapter or "").encode(), _pack(req.tools), _pack(req.chat_template_kwargs))
    lead = 0
    if req.messages is not None:
        parts = [_pack(m) for m in req.messages]
        while lead < len(req.messages) and isinstance(req.messages[lead], dict):
            if req.messages[lead].get("role") not in LEADING_ROLES:
                break
            lead += 1
    elif req.fim is not None:
        text = f"{req.fim.get('filename', '')}\0{req.fim.get('prefix', '')}"
        parts = [text[i : i + TEXT_CHUNK].encode("utf-8", "replace") for i in range(0, len(text), TEXT_CHUNK)]
    elif req.prompt is not None:
        text = req.prompt
        parts = [text[i : i + TEXT_CHUNK].encode("utf-8", "replace") for i in range(0, len(text), TEXT_CHUNK)]
    else:
        tokens = req.prompt_tokens or []
        parts = [_pack(tokens[i : i + TOKEN_CHUNK]) for i in range(0, len(tokens), TOKEN_CHUNK)]
    chain, last = [], seed
    for part in parts:
        last = _digest(last, part)
        chain.append(last)
    if not chain:
        chain.append(seed)
    lead = min(lead, len(chain) - 1)
    scoped = f"{namespace}\0{session}" if session else None
    anchor = _digest(seed, b"session", scoped.encode()) if scoped else chain[lead]
    return RouteKey(tuple(chain), lead, anchor, scoped)


class LazyRoute:
    """A request's route key, made when the pool first needs it (a model with one worker
    never hashes), and kept: what its answer says of the cache is read against it."""

    __slots__ = ("key", "_req", "_session")

    def __init__(self, req: p.WorkerRequest, session: str | None) -> None:
        self.key: RouteKey | None = None
        self._req, self._session = req, session

    def __call__(self) -> RouteKey | None:
        if self.key is None:
            self.key = key = route_key(self._req, self._session)
            if key is not None and isinstance(self._req, p.GenerateRequest):
                # Made only for a model with several workers: its worker reports what it stores
                # under these entries (PREFIXES), so the pool's index follows evictions.
                self._req.route = list(key.chain[max(key.lead, len(key.chain) - REPORTED_ENTRIES) :])
        return self.key


def rendezvous(anchor: bytes, label: str) -> bytes:
    """Highest random weight: each replica's score for the anchor; the highest one wins, and
    a replica leaving moves only the sessions it held."""
    return _digest(anchor, label.encode())
