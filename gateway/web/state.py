"""What the aiohttp application holds: typed keys instead of globals."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ...shared.gateway_config import GatewayConfig

if TYPE_CHECKING:  # the keys are typed for checkers; at run time state sits below both
    from ..link.broker import Broker
    from ..models.manager import ModelManager


@dataclass
class ImageLimits:
    max_bytes: int = 8 * 1024 * 1024  # per image
    max_images: int = 16  # per request
    allow_urls: bool = False  # fetch http(s) image URLs (public addresses only)
    fetch_timeout_s: float = 10.0


@dataclass
class GatewaySettings(GatewayConfig):
    """The gateway: section with `mlxgw up`'s flags applied (every field declared once, in
    shared/gateway_config.py), plus what only a running gateway has: the keys file and the
    metrics token (flags and environment only), and timings no one has needed to set."""

    write_timeout_s: float = 30.0  # an SSE write blocked this long ends the stream
    keepalive_s: float = 5.0  # SSE keep-alive comments while a request waits
    keys_path: Path | None = None  # None: no authentication (fine on 127.0.0.1)
    metrics_token: str | None = None  # bearer token for /metrics; None: open

    @classmethod
    def from_config(cls, config: GatewayConfig, **runtime: Any) -> GatewaySettings:
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(GatewayConfig)}
        return cls(**values, **runtime)

    @functools.cached_property
    def images(self) -> ImageLimits:
        """Vision inputs: sizes, count, URL fetching (built once, read per request)."""
        return ImageLimits(
            max_bytes=int(self.max_image_mb * (1 << 20)), max_images=self.max_images, allow_urls=self.allow_image_urls
        )


BROKER: web.AppKey[Broker] = web.AppKey("broker")
MANAGER: web.AppKey[ModelManager] = web.AppKey("manager")
SETTINGS = web.AppKey("settings", GatewaySettings)
KEYS = web.AppKey("keys", object)  # KeyStore | None
CACHE_SECRET = web.AppKey("cache_secret", bytes)  # prefix-cache namespaces' HMAC key (access/cache_scope.py)
LIMITER = web.AppKey("limiter", object)  # RateLimiter
METRICS = web.AppKey("metrics", object)  # Metrics
