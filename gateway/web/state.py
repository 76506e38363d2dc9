"""What the aiohttp application holds: typed keys instead of globals."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:  # the keys are typed for checkers; at run time state sits below both
    from mlxgw.gateway.link.broker import Broker
    from mlxgw.gateway.models.manager import ModelManager


@dataclass
class ImageLimits:
    max_bytes: int = 8 * 1024 * 1024  # per image
    max_images: int = 16  # per request
    allow_urls: bool = False  # fetch http(s) image URLs (public addresses only)
    fetch_timeout_s: float = 10.0


@dataclass
class GatewaySettings:
    request_timeout_s: float = 300.0  # generation, from the first token
    prefill_timeout_s: float = 900.0  # queue + prompt processing, until the first token
    write_timeout_s: float = 30.0
    keepalive_s: float = 5.0
    max_body_bytes: int = 10 * 1024 * 1024
    max_tokens_cap: int | None = None  # server-wide ceiling on max_tokens
    max_tokens_default: int | None = None  # when neither the request nor the model sets one
    max_connections: int = 1024  # connections and concurrent requests; past it 429 (health/control exempt)
    header_timeout_s: float = 10.0  # a request head must be complete this long after its first byte
    idle_timeout_s: float = 30.0  # a connection with no request in progress is closed after this
    body_timeout_s: float = 60.0  # a request body must be complete this long after its head
    keys_path: Path | None = None  # None: no authentication (fine on 127.0.0.1)
    metrics_token: str | None = None  # bearer token for /metrics; None: open
    log_format: str = "text"  # or "json": one access-log line per request
    log_prompts: bool = False
    cors_origins: tuple[str, ...] = ()
    images: ImageLimits = field(default_factory=ImageLimits)  # vision inputs: sizes, count, URL fetching


BROKER: web.AppKey[Broker] = web.AppKey("broker")
MANAGER: web.AppKey[ModelManager] = web.AppKey("manager")
SETTINGS = web.AppKey("settings", GatewaySettings)
KEYS = web.AppKey("keys", object)  # KeyStore | None
LIMITER = web.AppKey("limiter", object)  # RateLimiter
METRICS = web.AppKey("metrics", object)  # Metrics
