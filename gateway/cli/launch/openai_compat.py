"""Clients of the Chat Completions API: opencode, Qwen Code, Crush, goose, Continue CLI, aider.

Where a client keeps a user config file (opencode, Qwen Code, Crush), only the mlxgw provider
and the settings it needs are merged in; where a client takes a config file by flag
(Continue, aider), mlxgw's own file under $MLXGW_HOME/launch/ is written whole. Where a client
reads a variable instead of a literal key (opencode `{env:...}`, Crush `$VAR`), the files name
the variable and the key stays in the environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ....shared import paths
from .core import DELETE, ConfigEdit, Plan, ServerFacts

KEY_VARIABLE = "MLXGW_API_KEY"
CLIENT_NAMES = ("gpt-5", "gpt-4o")


def _config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def _own_dir() -> Path:
    return paths.home() / "launch"


def _key_env(facts: ServerFacts) -> dict[str, str]:
    return {KEY_VARIABLE: facts.key} if facts.key else {}


def opencode(facts: ServerFacts, args: list[str]) -> Plan:
    options = {
        "baseURL": f"{facts.url}/v1",
        "apiKey": f"{{env:{KEY_VARIABLE}}}" if facts.key else DELETE,
        "timeout": facts.request_timeout_ms(),
        "headerTimeout": facts.idle_timeout_ms(),  # headers wait for the first token's step
        "chunkTimeout": facts.idle_timeout_ms(),
    }
    limit = {"context": facts.context_length, "output": facts.max_output_tokens()}
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "mlxgw",
        "options": options,
        "models": {facts.model: {"name": f"{facts.model} (mlxgw)", "limit": limit}},
    }
    served = f"mlxgw/{facts.model}"
    env = {
        **_key_env(facts),
        # the model for this session only: the user's default model in the file stays theirs
        "OPENCODE_CONFIG_CONTENT": json.dumps({"model": served, "small_model": served}),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
    }
    path = _config_home() / "opencode" / "opencode.json"
    edit = ConfigEdit(path, "json", {"$schema": "https://opencode.ai/config.json", "provider": {"mlxgw": provider}})
    return Plan("opencode", "opencode", args, env, edits=[edit], install="npm install -g opencode-ai")


def qwen(facts: ServerFacts, args: list[str]) -> Plan:
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"generationConfig": {"timeout": facts.request_timeout_ms()}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }
    env = {"OPENAI_BASE_URL": f"{facts.url}/v1", "OPENAI_API_KEY": facts.token, "OPENAI_MODEL": facts.model}
    edit = ConfigEdit(Path.home() / ".qwen" / "settings.json", "json", settings)
    notes = []
    if facts.context_length < 10_000:
        notes.append(
            f"Qwen Code's first request is ~9,700 tokens, over this model's {facts.context_length}: try --bare"
        )
    return Plan("qwen", "qwen", args, env, edits=[edit], install="npm install -g @qwen-code/qwen-code", notes=notes)


def crush(facts: ServerFacts, args: list[str]) -> Plan:
    model = {
        "id": facts.model,
        "name": f"{facts.model} (mlxgw)",
        "context_window": facts.context_length,
        "default_max_tokens": facts.max_output_tokens(),
    }
    provider = {
        "type": "openai-compat",
        "base_url": f"{facts.url}/v1",
        "api_key": f"${KEY_VARIABLE}" if facts.key else "mlxgw-no-key",
        "models": [model],
    }
    chosen = {"model": facts.model, "provider": "mlxgw"}
    updates = {"providers": {"mlxgw": provider}, "models": {"large": chosen, "small": chosen}}
    edit = ConfigEdit(_config_home() / "crush" / "crush.json", "json", updates)
    env = {**_key_env(facts), "CRUSH_DISABLE_METRICS": "1", "DO_NOT_TRACK": "1"}
    return Plan(
        "crush",
        "crush",
        args,
        env,
        edits=[edit],
        install="npm install -g @charmland/crush",
        notes=["Crush's configuration follows its documentation; not run against mlxgw here"],
    )


def goose(facts: ServerFacts, args: list[str]) -> Plan:
    env = {
        "GOOSE_PROVIDER": "openai",
        "GOOSE_MODEL": facts.model,
        "OPENAI_HOST": facts.url,  # goose joins it with the base path itself
        "OPENAI_BASE_PATH": "v1/chat/completions",
        "OPENAI_API_KEY": facts.token,
        "GOOSE_CONTEXT_LIMIT": str(facts.context_length),
        "DO_NOT_TRACK": "1",
    }
    return Plan(
        "goose",
        "goose",
        args,
        env,
        install="curl -fsSL https://github.com/block/goose/releases/latest/download/download_cli.sh | bash",
        notes=["goose's configuration follows its documentation; not run against mlxgw here"],
    )


def continue_cli(facts: ServerFacts, args: list[str]) -> Plan:
    options = {"contextLength": facts.context_length, "maxTokens": facts.max_output_tokens()}
    config = {
        "name": "mlxgw",
        "version": "0.0.1",
        "schema": "v1",
        "models": [
            {
                "name": f"{facts.model} (mlxgw)",
                "provider": "openai",
                "model": facts.model,
                "apiBase": f"{facts.url}/v1",
                "apiKey": facts.token,  # the file is owner-only; Continue has no variable for it
                "roles": ["chat", "edit", "apply"],
                "defaultCompletionOptions": options,
            }
        ],
    }
    path = _own_dir() / "continue.yaml"
    return Plan(
        "continue",
        "cn",
        ["--config", str(path), *args],
        edits=[ConfigEdit(path, "yaml", config, replace=True)],
        install="npm install -g @continuedev/cli",
    )


def aider(facts: ServerFacts, args: list[str]) -> Plan:
    name = f"openai/{facts.model}"
    metadata = {
        name: {
            "max_input_tokens": facts.context_length,
            "max_output_tokens": facts.max_output_tokens(),
            "input_cost_per_token": 0,
            "output_cost_per_token": 0,
            "litellm_provider": "openai",
            "mode": "chat",
        }
    }
    # whole-file edits and the format reminder as a system turn: what docs/agents.md ran
    settings = [{"name": name, "edit_format": "whole", "reminder": "sys"}]
    folder = _own_dir() / "aider"
    meta_path, settings_path = folder / "model.metadata.json", folder / "model.settings.yml"
    flags = ["--model", name, "--model-metadata-file", str(meta_path), "--model-settings-file", str(settings_path)]
    flags += ["--no-check-update", "--analytics-disable", "--timeout", str(facts.request_timeout_ms() // 1000)]
    env = {
        "OPENAI_API_BASE": f"{facts.url}/v1",
        "OPENAI_API_KEY": facts.token,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's bundled model list, not the internet's
    }
    edits = [
        ConfigEdit(meta_path, "json", metadata, replace=True),
        ConfigEdit(settings_path, "yaml", settings, replace=True),
    ]
    return Plan("aider", "aider", [*flags, *args], env, edits=edits, install="pipx install aider-chat")
