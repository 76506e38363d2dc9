"""Poison-request quarantine: a request shape in flight at two worker crashes is refused.

Each request sent to a worker gets a fingerprint of its internal form (everything but its
ids). When a worker crashes, the fingerprints of its requests in flight are counted; one
counted at QUARANTINE_CRASHES crashes of a model is refused from then on with a 400 naming
it. One user can then cost a model at most two restarts, never a crash loop."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import msgpack

from ...shared.errors import ErrorCode, ServiceError

log = logging.getLogger(__name__)

QUARANTINE_CRASHES = 2
MAX_TRACKED = 4096  # fingerprints remembered per gateway (oldest forgotten first)
UNFINGERPRINTED = ("rid", "timeout_s", "priority", "tenant", "weight")  # who sent it is not what crashes


def fingerprint(wire: dict) -> str:
    """A short stable hash of a request's content. Raises what msgpack raises for values it
    cannot encode (the caller turns that into a 400 before anything is registered)."""
    body = {k: v for k, v in wire.items() if k not in UNFINGERPRINTED}
    return hashlib.blake2b(msgpack.packb(body, use_bin_type=True), digest_size=8).hexdigest()


class Quarantine:
    def __init__(self, crashes_to_refuse: int = QUARANTINE_CRASHES, max_tracked: int = MAX_TRACKED):
        self.crashes_to_refuse = crashes_to_refuse
        self.max_tracked = max_tracked
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.refused = 0

    def record_crash(self, model: str, fingerprints: list[str]) -> None:
        for fp in set(fingerprints):
            key = (model, fp)
            n = self._counts.pop(key, 0) + 1
            self._counts[key] = n
            if n == self.crashes_to_refuse:
                log.warning("request %s was in flight at %d crashes of %s; it is quarantined", fp, n, model)
        while len(self._counts) > self.max_tracked:
            self._counts.popitem(last=False)

    def watching(self, model: str) -> bool:
        """Whether any request shape of this model has been in flight at a crash (only then
        does a new request need its fingerprint checked)."""
        return any(m == model for m, _ in self._counts)

    def check(self, model: str, fp: str) -> None:
        n = self._counts.get((model, fp), 0)
        if n >= self.crashes_to_refuse:
            self.refused += 1
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                f"this request (fingerprint {fp}) was in flight at {n} crashes of the worker serving {model}; "
                "it is refused so that it cannot take the model away from everyone else",
            )

    def quarantined(self) -> list[dict]:
        return [
            {"model": m, "fingerprint": fp, "crashes": n}
            for (m, fp), n in self._counts.items()
            if n >= self.crashes_to_refuse
        ]

    def forget_model(self, model: str) -> None:
        """A reload that changes a model forgets its history: the new settings may fix it."""
        for key in [k for k in self._counts if k[0] == model]:
            del self._counts[key]
