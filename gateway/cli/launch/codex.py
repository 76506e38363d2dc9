"""Codex: a profile layer, $CODEX_HOME/mlxgw.config.toml, started with `codex --profile mlxgw`.

Codex 0.171 layers `<name>.config.toml` over the user's config.toml, so the user's own model,
provider and settings stay untouched for plain `codex`. The provider speaks the Responses API;
`env_key` is set only while keys are on (Codex refuses to start when the variable it names is
unset, docs/agents.md), and removed again when they are off."""

from __future__ import annotations

import os
from pathlib import Path

from .core import DELETE, ConfigEdit, Plan, ServerFacts

PROFILE = "mlxgw"
KEY_VARIABLE = "MLXGW_API_KEY"
CLIENT_NAMES = ("gpt-5-codex", "codex-mini")


def codex_home() -> Path:
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")


def plan(facts: ServerFacts, args: list[str]) -> Plan:
    provider = {
        "name": "mlxgw",
        "base_url": f"{facts.url}/v1",
        "wire_api": "responses",
        "stream_idle_timeout_ms": facts.idle_timeout_ms(),
        "env_key": KEY_VARIABLE if facts.key else DELETE,
    }
    layer = {
        # a name outside Codex's catalog: plain function tools, not code mode (docs/agents.md)
        "model": facts.model,
        "model_provider": PROFILE,
        "model_context_window": facts.context_length,
        "model_auto_compact_token_limit": facts.context_length * 3 // 4,
        "check_for_update_on_startup": False,
        "analytics": {"enabled": False},
        "model_providers": {PROFILE: provider},
    }
    env = {KEY_VARIABLE: facts.key} if facts.key else {}
    return Plan(
        client="codex",
        binary="codex",
        args=["--profile", PROFILE, *args],
        env=env,
        edits=[ConfigEdit(codex_home() / f"{PROFILE}.config.toml", "toml", layer)],
        install="npm install -g @openai/codex",
    )
