"""The `mcp:` section of models.yaml: MCP servers the gateway connects to and runs tools on.

    mcp:
      max_turns: 8                  # model turns one request may spend on MCP calls
      total_timeout_s: 120    # all MCP turns of one request together
      servers:
        - label: files              # what requests name: {"type": "mcp", "server_label": "files"}
          command: python           # stdio: a process the gateway starts
          args: [files_server.py]
          env: {ROOT: /srv/docs}
          allowed_tools: [read_file] # omitted: every tool the server lists
          timeout_s: 30       # one tool call
        - label: search
          url: http://127.0.0.1:9000/mcp   # streamable HTTP

Kept apart from config.py so that file only gains a field and a call."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .schema import ConfigError, from_mapping

LABEL_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class McpServerConfig:
    label: str
    command: str | None = None  # stdio transport
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # streamable HTTP transport
    allowed_tools: list[str] | None = None  # None: all the server lists
    timeout_s: float = 30.0  # one tool call
    connect_timeout_s: float = 30.0  # starting the process/session and listing tools

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "streamable-http"

    def allows(self, tool: str) -> bool:
        return self.allowed_tools is None or tool in self.allowed_tools


@dataclass
class McpConfig:
    servers: list[McpServerConfig] = field(default_factory=list)
    max_turns: int = 8
    total_timeout_s: float = 120.0

    def server(self, label: str) -> McpServerConfig | None:
        return next((s for s in self.servers if s.label == label), None)


def _env(raw, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ConfigError(f"{where}: field 'env': expected a mapping of strings to strings")
    return dict(raw)


def _server(raw, where: str) -> McpServerConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    raw = dict(raw)
    env = _env(raw.pop("env", None), where)
    s = from_mapping(McpServerConfig, raw, where)
    s.env = env
    if not LABEL_RE.match(s.label or ""):
        raise ConfigError(f"{where}: field 'label': letters, digits, '_' and '-' only, got {s.label!r}")
    if bool(s.command) == bool(s.url):
        raise ConfigError(f"{where}: give either 'command' (stdio) or 'url' (streamable HTTP)")
    if s.url and not s.url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: field 'url': must be http:// or https://")
    if s.timeout_s <= 0 or s.connect_timeout_s <= 0:
        raise ConfigError(f"{where}: timeouts must be positive")
    return s


def parse_mcp(data, src: str) -> McpConfig:
    if data is None:
        return McpConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: mcp: expected a mapping")
    data = dict(data)
    raw_servers = data.pop("servers", None) or []
    if not isinstance(raw_servers, list):
        raise ConfigError(f"{src}: mcp: 'servers' must be a list")
    cfg = from_mapping(McpConfig, data, f"{src}: mcp")
    cfg.servers = [_server(raw, f"{src}: mcp.servers[{i}]") for i, raw in enumerate(raw_servers)]
    labels = [s.label for s in cfg.servers]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise ConfigError(f"{src}: mcp: duplicate server label {dup!r}")
    if cfg.max_turns < 1 or cfg.total_timeout_s <= 0:
        raise ConfigError(f"{src}: mcp: max_turns must be at least 1 and total_timeout_s positive")
    return cfg
