"""What the aiohttp application holds: typed keys instead of globals."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from shared.config import Registry

from .broker import Broker
from .manager import ModelManager


@dataclass
class GatewaySettings:
    request_timeout_s: float = 300.0
    write_timeout_s: float = 30.0
    keepalive_s: float = 5.0
    max_body_bytes: int = 10 * 1024 * 1024
    max_tokens_cap: int | None = None  # server-wide ceiling on max_tokens


REGISTRY = web.AppKey("registry", Registry)
BROKER = web.AppKey("broker", Broker)
MANAGER = web.AppKey("manager", ModelManager)
SETTINGS = web.AppKey("settings", GatewaySettings)
