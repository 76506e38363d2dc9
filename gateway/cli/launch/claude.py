"""Claude Code: configured by environment only (its settings.json is left alone).

The variables are the ones the agent tests and docs/agents.md found necessary: the base URL,
a bearer token (ANTHROPIC_AUTH_TOKEN: no "use this API key?" prompt), every model tier on
the served model, its stream idle and request timeouts above the longest prefill, the
compaction window and output cap from the model's context, and no traffic but the API's."""

from __future__ import annotations

from .core import Plan, ServerFacts

# Names Claude Code asks for by default; the alias table decides which model they reach.
CLIENT_NAMES = ("claude-sonnet-4-5", "claude-opus-4-1")
# Claude Code 2.1.332 refuses its own first request ("Prompt is too long", before sending it)
# when told a window of 16,384 tokens (it keeps a reserve and counts the full tool listing,
# which mlxgw shortens); 32,768 works. Smaller contexts are left to the server, whose
# "prompt is too long" makes Claude Code compact (docs/agents.md).
MIN_DECLARED_CONTEXT = 32_768
TIERS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)


def plan(facts: ServerFacts, args: list[str]) -> Plan:
    env = {
        "ANTHROPIC_BASE_URL": facts.url,
        "ANTHROPIC_AUTH_TOKEN": facts.token,
        **{tier: facts.model for tier in TIERS},
        "API_TIMEOUT_MS": str(facts.request_timeout_ms()),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(facts.idle_timeout_ms()),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(facts.context_length),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(facts.max_output_tokens()),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    if facts.context_length >= MIN_DECLARED_CONTEXT:
        # the window it reports and plans with (without it, 1,000,000 tokens)
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(facts.context_length)
    return Plan(
        client="claude",
        binary="claude",
        args=args,
        env=env,
        # an Anthropic key in the user's environment must not travel to this server
        unset=["ANTHROPIC_API_KEY"],
        install="npm install -g @anthropic-ai/claude-code",
    )
