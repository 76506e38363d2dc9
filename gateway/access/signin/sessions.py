"""Console sessions after a sign-in: a random id in an HttpOnly, SameSite=Strict cookie,
signed with a secret kept in MLXGW_HOME, looked up in a table the gateway holds, so that
signing out or an admin's revocation ends a session at once, whatever the cookie says.

The table keeps each session by the SHA-256 of its id (a copy of sessions.json opens no
session) and survives a restart; it is bounded, the oldest sessions leaving first."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .people import Person

log = logging.getLogger(__name__)

COOKIE = "mlxgw_session"
MAX_SESSIONS = 10_000


@dataclass(frozen=True)
class Session:
    id: str  # the SHA-256 of the cookie's id, shortened: what admins list and revoke by
    person: Person
    created: float
    expires: float

    def public(self) -> dict:
        return {"id": self.id, **self.person.public(), "created": self.created, "expires": self.expires}


def _sign(secret: bytes, sid: str) -> str:
    mac = hmac.new(secret, b"mlxgw-session\0" + sid.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def _session_id(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()[:32]


class Sessions:
    def __init__(self, secret: bytes, ttl_s: float, path: Path | None) -> None:
        self.secret, self.ttl_s, self.path = secret, ttl_s, path
        self._by_id: dict[str, Session] = {}
        self._lock = threading.Lock()  # save() runs off the event loop
        self._load()

    def create(self, person: Person, now: float | None = None) -> str:
        """A new session for the person; returns the cookie's value (shown to no one else)."""
        now = time.time() if now is None else now
        sid = secrets.token_urlsafe(32)
        session = Session(_session_id(sid), person, now, now + self.ttl_s)
        with self._lock:
            for old in [s.id for s in self._by_id.values() if s.expires <= now]:
                del self._by_id[old]
            self._by_id[session.id] = session
            while len(self._by_id) > MAX_SESSIONS:
                self._by_id.pop(next(iter(self._by_id)))  # dicts keep insertion order: the oldest
        return f"{sid}.{_sign(self.secret, sid)}"

    def lookup(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The live session a cookie opens, or None (unsigned, forged, expired or revoked)."""
        if not cookie or cookie.count(".") != 1:
            return None
        sid, sig = cookie.split(".")
        if not hmac.compare_digest(sig.encode(), _sign(self.secret, sid).encode()):
            return None
        session = self._by_id.get(_session_id(sid))
        if session is None or session.expires <= (time.time() if now is None else now):
            return None
        return session

    def revoke(self, session_id: str) -> bool:
        with self._lock:
            return self._by_id.pop(session_id, None) is not None

    def revoke_cookie(self, cookie: str | None) -> bool:
        session = self.lookup(cookie)
        return session is not None and self.revoke(session.id)

    def live(self, now: float | None = None) -> list[Session]:
        now = time.time() if now is None else now
        return [s for s in list(self._by_id.values()) if s.expires > now]

    def save(self) -> None:
        """Write the live sessions (call it off the event loop): atomic, 0600."""
        if self.path is None:
            return
        with self._lock:
            rows = [{**dataclasses.asdict(s), "person": dataclasses.asdict(s.person)} for s in self.live()]
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                os.fchmod(fd, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(rows, f)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            for row in json.loads(self.path.read_text()):
                person = Person(**{**row["person"], "groups": tuple(row["person"]["groups"])})
                self._by_id[row["id"]] = Session(row["id"], person, row["created"], row["expires"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("sessions file %s unreadable, everyone signs in again: %s", self.path, e)
            self._by_id.clear()
