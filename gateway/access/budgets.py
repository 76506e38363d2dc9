"""Per-key token budgets per UTC day (`tpd`) and per UTC calendar month (`tpmo`), and the
registry of each key's requests in flight.

The budgets count what the usage ledger records (prompt + completion tokens of finished
requests), seeded from the ledger's SQLite file at start, so a restart forgets nothing. As
with `tpm`, a request is admitted while its key is under its budget (past it: a 429 with
Retry-After at the next UTC midnight or month), and it sets aside what it may generate (its
max_tokens times n, at most what is left): while requests in flight have set aside all that is
left, the next waits (a 429 to retry in a second). A request's tokens count the moment it ends
(settle), before the ledger's row for it arrives. So many requests at once, a batch's
included, cannot each pass the budget: a key goes past it by at most the prompts of its
requests in flight and the one request admitted last (300 tokens a day had run
48,024)."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from .keys import ApiKey

UTC = dt.timezone.utc


def day_start(ts: float) -> float:
    d = dt.datetime.fromtimestamp(ts, UTC)
    return dt.datetime(d.year, d.month, d.day, tzinfo=UTC).timestamp()


def month_start(ts: float) -> float:
    d = dt.datetime.fromtimestamp(ts, UTC)
    return dt.datetime(d.year, d.month, 1, tzinfo=UTC).timestamp()


def next_month_start(ts: float) -> float:
    d = dt.datetime.fromtimestamp(ts, UTC)
    year, month = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
    return dt.datetime(year, month, 1, tzinfo=UTC).timestamp()


@dataclass
class TokenBudgets:
    """Tokens used per key today and this month (UTC), kept in memory and fed by the ledger;
    by the key's identity (ApiKey.tenant), never its name, so a key revoked and created again
    under the same name starts afresh, and one renamed keeps what it has spent."""

    day: dict[str, int] = field(default_factory=dict)
    month: dict[str, int] = field(default_factory=dict)
    _day_of: float = 0.0
    _month_of: float = 0.0
    reserved: dict[str, int] = field(default_factory=dict)  # key identity -> tokens set aside in flight
    _settled: dict[str, int] = field(default_factory=dict)  # counted by settle, the ledger's add to come

    def _roll(self, now: float) -> None:
        today, this_month = day_start(now), month_start(now)
        if today != self._day_of:
            self.day, self._day_of = {}, today
        if this_month != self._month_of:
            self.month, self._month_of = {}, this_month

    def seed(self, day_totals: dict[str, int], month_totals: dict[str, int], now: float | None = None) -> None:
        self._roll(now or time.time())
        self.day.update(day_totals)
        self.month.update(month_totals)

    def add(self, key: str, tokens: int, ts: float) -> None:
        """The ledger's row of a finished request; what settle counted already is not again."""
        early = min(tokens, self._settled.get(key, 0))
        if early:
            self._settled[key] -= early
            tokens -= early
        if tokens <= 0:
            return
        self._roll(ts)
        self.day[key] = self.day.get(key, 0) + tokens
        self.month[key] = self.month.get(key, 0) + tokens

    def used(self, key: str, now: float | None = None) -> tuple[int, int]:
        self._roll(now or time.time())
        return self.day.get(key, 0), self.month.get(key, 0)

    def check(self, key: ApiKey) -> None:
        """Raise the 429 of a spent budget, in the same shape as the rate limits'."""
        if key.tpd is None and key.tpmo is None:
            return
        now = time.time()
        day_used, month_used = self.used(key.tenant, now)
        if key.tpd is not None and day_used >= key.tpd:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"daily token budget reached for key '{key.name}': {key.tpd} tokens per UTC day",
                retry_after=day_start(now) + 86400 - now,
            )
        if key.tpmo is not None and month_used >= key.tpmo:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"monthly token budget reached for key '{key.name}': {key.tpmo} tokens per UTC month",
                retry_after=next_month_start(now) - now,
            )

    def reserve(self, key: ApiKey, tokens: int) -> int:
        """Set aside up to `tokens` (a request's max_tokens) of what is left of the key's daily
        and monthly budgets, or raise a 429 when requests in flight have set all of it aside;
        what was set aside (0 without budgets), released by settle."""
        if (key.tpd is None and key.tpmo is None) or tokens <= 0:
            return 0
        now = time.time()
        day_used, month_used = self.used(key.tenant, now)
        held = self.reserved.get(key.tenant, 0)
        for limit, used, per in ((key.tpd, day_used, "UTC day"), (key.tpmo, month_used, "UTC month")):
            if limit is None:
                continue
            if used < limit <= used + held:
                raise ServiceError(
                    ErrorCode.RATE_LIMITED,
                    f"token budget of key '{key.name}' set aside: {limit} tokens per {per}, {used} used and "
                    f"the other {limit - used} set aside by its requests in flight; retry when one ends",
                    retry_after=1.0,
                )
            tokens = min(tokens, max(0, limit - used - held))
        self.reserved[key.tenant] = held + tokens
        return tokens

    def settle(self, ident: str, reserved: int, used: int) -> None:
        """A request ended: release what it set aside and count what it used now."""
        if reserved:
            self.reserved[ident] = max(0, self.reserved.get(ident, 0) - reserved)
        if used > 0:
            self.add(ident, used, time.time())
            self._settled[ident] = self._settled.get(ident, 0) + used

    def headers(self, key: ApiKey) -> dict[str, str]:
        out: dict[str, str] = {}
        if key.tpd is None and key.tpmo is None:
            return out
        day_used, month_used = self.used(key.tenant)
        if key.tpd is not None:
            out["x-ratelimit-limit-tokens-day"] = str(key.tpd)
            out["x-ratelimit-remaining-tokens-day"] = str(max(0, key.tpd - day_used))
        if key.tpmo is not None:
            out["x-ratelimit-limit-tokens-month"] = str(key.tpmo)
            out["x-ratelimit-remaining-tokens-month"] = str(max(0, key.tpmo - month_used))
        return out


@dataclass
class InFlight:
    """The requests in flight per key name: what a revocation must end. (aiohttp requests
    are mappings, so unhashable: they are held by id.)"""

    by_key: dict[str, dict[int, web.Request]] = field(default_factory=dict)

    def add(self, name: str, request: web.Request) -> None:
        self.by_key.setdefault(name, {})[id(request)] = request

    def remove(self, name: str, request: web.Request) -> None:
        held = self.by_key.get(name)
        if held is not None:
            held.pop(id(request), None)
            if not held:
                del self.by_key[name]

    def holds(self, name: str, request: web.Request) -> bool:
        return id(request) in self.by_key.get(name, {})

    def of(self, name: str) -> list[web.Request]:
        return list(self.by_key.get(name, {}).values())

    def all(self) -> list[web.Request]:
        return [r for held in self.by_key.values() for r in held.values()]
