"""Per-key rate limits: requests, tokens and audio seconds per sliding window, and a
concurrency cap.

Kept in the gateway's memory: one process serves the whole machine, so no Redis or
Postgres is needed for quotas."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ...shared.errors import ErrorCode, ServiceError
from .keys import ApiKey


@dataclass
class _Usage:
    requests: deque = field(default_factory=deque)  # request start times
    tokens: deque = field(default_factory=deque)  # (time, tokens)
    token_sum: int = 0
    reserved: int = 0  # tokens set aside for requests in flight (their max_tokens)
    concurrent: int = 0
    audio: deque = field(default_factory=deque)  # (time, seconds of audio)
    audio_sum: float = 0.0


class RateLimiter:
    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}  # by the key's identity (ApiKey.tenant)

    def _of(self, key: ApiKey) -> _Usage:
        """A key's counters, by its identity, never its name: a key revoked and created again
        under the same name starts afresh, and one renamed keeps what it has used."""
        return self._usage.setdefault(key.tenant, _Usage())

    def _prune(self, u: _Usage, now: float, window: float) -> None:
        while u.requests and u.requests[0] <= now - window:
            u.requests.popleft()
        while u.tokens and u.tokens[0][0] <= now - window:
            u.token_sum -= u.tokens.popleft()[1]
        while u.audio and u.audio[0][0] <= now - window:
            u.audio_sum -= u.audio.popleft()[1]

    def start(self, key: ApiKey, window: float) -> None:
        """Admit one request for the key or raise a 429 saying when to retry."""
        now = time.monotonic()
        u = self._of(key)
        self._prune(u, now, window)
        if key.rpm is not None and len(u.requests) >= key.rpm:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"rate limit reached for key '{key.name}': {key.rpm} requests per {window:g} s",
                retry_after=u.requests[0] + window - now,
            )
        if key.tpm is not None and u.token_sum >= key.tpm:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"token limit reached for key '{key.name}': {key.tpm} tokens per {window:g} s",
                retry_after=u.tokens[0][0] + window - now if u.tokens else window,
            )
        if key.max_concurrent is not None and u.concurrent >= key.max_concurrent:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"too many concurrent requests for key '{key.name}' (limit {key.max_concurrent})",
                retry_after=1.0,
            )
        u.requests.append(now)
        u.concurrent += 1

    def reserve(self, key: ApiKey, window: float, tokens: int) -> int:
        """Set aside up to `tokens` of the key's token budget for one request, or raise a
        429: the budget is a hard limit, so a request that could pass it is not started.
        Returns what was reserved (0 when the key has no token limit)."""
        if key.tpm is None or tokens <= 0:
            return 0
        if tokens > key.tpm:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"this request may use up to {tokens} tokens (its max_tokens), more than the "
                f"{key.tpm} tokens per {window:g} s of key '{key.name}'; lower max_tokens",
                param="max_tokens",
            )
        now = time.monotonic()
        u = self._of(key)
        self._prune(u, now, window)
        if u.token_sum + u.reserved + tokens > key.tpm:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"token limit reached for key '{key.name}': {key.tpm} tokens per {window:g} s "
                f"({u.token_sum} used, {u.reserved} reserved by requests in flight, this one needs up to {tokens})",
                retry_after=u.tokens[0][0] + window - now if u.tokens else 1.0,
            )
        u.reserved += tokens
        return tokens

    def add_rows(self, key: ApiKey, extra: int) -> int:
        """A request asking for `n` choices runs as n rows: count the n - 1 beyond the one
        start() counted against the key's max_concurrent, or raise a 429 (param n when it
        could never fit). Returns what was added, released by finish(rows=...)."""
        if key.max_concurrent is None or extra <= 0:
            return 0
        if extra + 1 > key.max_concurrent:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"n = {extra + 1} runs {extra + 1} requests at once, more than the {key.max_concurrent} "
                f"concurrent requests of key '{key.name}'; lower n",
                param="n",
            )
        u = self._of(key)
        if u.concurrent + extra > key.max_concurrent:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"too many concurrent requests for key '{key.name}' (limit {key.max_concurrent}; "
                f"{u.concurrent} running, n = {extra + 1} needs {extra + 1})",
                retry_after=1.0,
            )
        u.concurrent += extra
        return extra

    def charge_audio(self, key: ApiKey, window: float, seconds: float) -> None:
        """Count an upload's decoded duration against the key's audio seconds per window
        (`aspm`), or raise a 429: known before the model sees the audio, so it is a hard limit."""
        if key.aspm is None:
            return
        if seconds > key.aspm:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"this file holds {seconds:.1f} s of audio, more than the {key.aspm} audio seconds per "
                f"{window:g} s of key '{key.name}'",
                param="file",
            )
        now = time.monotonic()
        u = self._of(key)
        self._prune(u, now, window)
        if u.audio_sum + seconds > key.aspm:
            raise ServiceError(
                ErrorCode.RATE_LIMITED,
                f"audio limit reached for key '{key.name}': {key.aspm} audio seconds per {window:g} s "
                f"({u.audio_sum:.1f} used, this file holds {seconds:.1f})",
                retry_after=u.audio[0][0] + window - now if u.audio else 1.0,
            )
        u.audio.append((now, seconds))
        u.audio_sum += seconds

    def finish(self, key: ApiKey, tokens: int, reserved: int = 0, rows: int = 0) -> None:
        """Settle one request: release its reservation (and the extra rows of its n) and
        charge what it really used."""
        u = self._of(key)
        u.concurrent = max(0, u.concurrent - 1 - rows)
        u.reserved = max(0, u.reserved - reserved)
        if tokens > 0:
            u.tokens.append((time.monotonic(), tokens))
            u.token_sum += tokens

    def headers(self, key: ApiKey, window: float) -> dict[str, str]:
        now = time.monotonic()
        u = self._of(key)
        self._prune(u, now, window)
        out = {}
        if key.rpm is not None:
            out["x-ratelimit-limit-requests"] = str(key.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, key.rpm - len(u.requests)))
        if key.tpm is not None:
            out["x-ratelimit-limit-tokens"] = str(key.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, key.tpm - u.token_sum - u.reserved))
        if key.aspm is not None:
            out["x-ratelimit-limit-audio-seconds"] = str(key.aspm)
            out["x-ratelimit-remaining-audio-seconds"] = str(max(0, int(key.aspm - u.audio_sum)))
        return out
