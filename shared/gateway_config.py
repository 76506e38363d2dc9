"""models.yaml's `gateway:` section, declared once: each field's type, default and help text,
and the `mlxgw up` flag that overrides it (gateway/cli/serve.py builds the flags from this
metadata; gateway/web/state.py:GatewaySettings extends the class with what only a running
gateway has). A new setting is one field here plus its line in config/models.example.yaml."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .model_sections import LogFormat


def setting(default: Any, help: str, *, flag: str | None = None, minimum: float | None = None) -> Any:
    """A gateway field: its default, its help (the flag's and the docs'), its `mlxgw up` flag
    (None: models.yaml only) and the smallest value the flag takes (the file's ranges are
    checked in shared/config_checks.py)."""
    metadata = {"help": help, "flag": flag, "minimum": minimum}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class GatewayConfig:
    """The HTTP side."""

    host: str = setting("127.0.0.1", "address to listen on", flag="--host")
    port: int = setting(8000, "HTTP port", flag="--port")
    request_timeout_s: float = setting(300.0, "seconds for an answer, from its first token", flag="--timeout")
    # Queue + prompt processing until the first token: agents send 5-10k-token prompts, which a
    # slow host may take minutes to prefill (kept apart so prefill never eats the answer's time).
    prefill_timeout_s: float = setting(
        900.0, "seconds from arrival to the first token (queue + prompt processing)", flag="--prefill-timeout"
    )
    max_body_bytes: int = setting(10 * 1024 * 1024, "larger request bodies get 413")
    max_connections: int = setting(
        1024,
        "open connections and concurrent requests, kept below the file-descriptor limit",
        flag="--max-connections",
        minimum=1,
    )
    header_timeout_s: float = setting(
        10.0, "a request head must be complete this long after its first byte", flag="--header-timeout", minimum=0.1
    )
    body_timeout_s: float = setting(
        60.0, "a body must be complete this long after its head (408)", flag="--body-timeout", minimum=0.1
    )
    idle_timeout_s: float = setting(
        30.0, "a keep-alive connection with no request is closed after this", flag="--idle-timeout", minimum=0.1
    )
    cors_origins: list[str] = setting([], "origins allowed by CORS (the flag: comma-separated)", flag="--cors-origins")
    max_tokens_cap: int | None = setting(None, "server-wide ceiling on max_tokens", flag="--max-tokens-cap")
    max_tokens_default: int | None = setting(
        None,
        "max_tokens when neither the request nor the model entry sets one (unset: the model's "
        "generation_config.json max_new_tokens, else 4096)",
        flag="--max-tokens-default",
    )
    max_image_mb: float = setting(8.0, "largest accepted image", flag="--max-image-mb")
    max_images: int = setting(16, "images per request")
    allow_image_urls: bool = setting(
        False, "fetch http(s) image URLs for vision models (public addresses only)", flag="--allow-image-urls"
    )
    log_format: LogFormat = setting("text", "access log: text, or json (one object per request)", flag="--log-format")
    log_prompts: bool = setting(False, "include prompts in the access log", flag="--log-prompts")
    # Prefix-cache hits reveal what another key sent (docs/operations.md, "What is shared and
    # with whom"): unset, each key's prompts are cached for that key only.
    default_cache_group: str | None = setting(
        None,
        "the prefix-cache group of API keys that name none (unset: each key its own)",
        flag="--default-cache-group",
    )
    # Latency classes (gateway/pipeline/latency_class.py): each class's target time to first
    # token; a worker admits the earliest arrival + target first within a priority.
    ttft_target_editor_s: float = setting(0.5, "target seconds to first token: editor completion (FIM, /infill)")
    ttft_target_chat_s: float = setting(1.0, "target seconds to first token: interactive chat")
    ttft_target_agent_s: float = setting(3.0, "target seconds to first token: agents (requests with tools)")
    ttft_target_background_s: float = setting(60.0, "target seconds to first token: background (batch, flex)")
    # The audit trail ($MLXGW_HOME/audit.jsonl): the oldest entries are dropped past either bound,
    # and an anchor keeps what is left verifiable.
    audit_retention_days: float | None = setting(365.0, "days the audit trail keeps an entry (null: forever)")
    audit_max_bytes: int | None = setting(64 * 1024 * 1024, "the audit trail's largest size in bytes (null: no bound)")
    # Sign-in with the team's OpenID Connect provider (gateway/access/signin/): the console's
    # authorization code flow with PKCE, the provider's groups as roles and cache groups, and
    # optionally its access tokens (JWTs) as API keys. Unset issuer: keys only, as before.
    oidc_issuer: str | None = setting(None, "the OpenID provider's issuer URL (unset: none)", flag="--oidc-issuer")
    oidc_client_id: str | None = setting(None, "the gateway's client id at the provider", flag="--oidc-client-id")
    # No flag: a flag shows in `ps`; MLXGW_OIDC_CLIENT_SECRET in the environment overrides it.
    oidc_client_secret: str | None = setting(None, "the client secret (or MLXGW_OIDC_CLIENT_SECRET)")
    public_url: str | None = setting(
        None,
        "the gateway's address as browsers reach it (the sign-in's redirect; unset: the request's host)",
        flag="--public-url",
    )
    oidc_scopes: list[str] = setting(["openid", "profile", "email", "groups"], "scopes the sign-in asks for")
    oidc_groups_claim: str = setting("groups", "the claim that lists a person's groups")
    oidc_admin_groups: list[str] = setting([], "provider groups whose members are admins")
    oidc_manage_models_groups: list[str] = setting([], "provider groups whose members may manage models")
    oidc_cache_groups: list[str] = setting(
        [], "provider groups that are cache groups: a person's first one is their keys' cache_group"
    )
    oidc_session_hours: float = setting(8.0, "how long a console sign-in lasts")
    oidc_accept_access_tokens: bool = setting(False, "accept the provider's JWT access tokens as API keys")
    oidc_audience: str | None = setting(None, "the audience an accepted access token must name (unset: the client id)")
