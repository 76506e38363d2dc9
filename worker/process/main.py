"""Worker process entry: connect, announce, load the model, serve until told to stop."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.model_sections import CHAT_KINDS, ENCODER_KINDS, ModelEntry, ModelKind
from ...shared.platform import total_memory_bytes
from ...shared.schema import from_mapping
from ..model.cache.prefix_store import restore_into, save_from
from ..model.memory.capacity import SeqsChoice, choose_max_num_seqs
from ..schedule.preprocess import Preprocessor
from .engine import Engine
from .helper_child import start_helper_child
from .link import WorkerLink
from .load_progress import LoadProgress

log = logging.getLogger(__name__)

# A KV budget that holds fewer tokens for one request than this (or the context) is logged.
SHORT_KV_BUDGET_TOKENS = 4096
# Layer progress marks turn on once a step takes this fraction of the hang bound (5 s of 120 s).
LONG_STEP_DIVISOR = 24


def _encoder(entry: ModelEntry, model_path: Path):
    from ..model.encoder.encoder import MlxEmbeddingsEncoder, TextEncoder

    encoder_cls = MlxEmbeddingsEncoder if entry.engine == "mlx-embeddings" else TextEncoder
    encoder = encoder_cls(model_path, max_length=entry.context_length, truncate=entry.encoder.truncate)
    if encoder.cross_encoder != (entry.kind == ModelKind.RERANK):
        rerank, embedding = "a cross-encoder (set kind: rerank)", "an embedding model (kind: embedding)"
        raise ValueError(f"{model_path.name} is {rerank if encoder.cross_encoder else embedding}")
    return encoder


def _speech(entry: ModelEntry, model_path: Path):  # speech to text (Whisper) or text to speech (Piper)
    if entry.kind == ModelKind.AUDIO:
        from ..model.whisper.runner import WhisperRunner

        return WhisperRunner(model_path)
    from ..model.speech.runner import PiperRunner

    return PiperRunner(model_path)


def _vision(entry: ModelEntry, model_path: Path):
    from ..model.runners.vision_runner import VisionRunner

    chat = entry.chat
    return VisionRunner(
        model_path,
        context_length=entry.context_length,
        max_num_seqs=entry.max_num_seqs,
        prefill_step_size=entry.prefill_step_size,
        tool_parser=chat.tool_parser,
        reasoning_parser=chat.reasoning_parser,
        allow_request_chat_template=chat.allow_request_chat_template,
        chat_template=chat.chat_template,
        prefix_memory_mb=entry.cache.prefix_memory_mb,
    )


def _image(entry: ModelEntry, model_path: Path):
    from ..model.image.runner import ImageRunner

    return ImageRunner(model_path)


def _null(entry: ModelEntry, model_path: Path):
    from ..model.runners.null_runner import EchoRunner, NullRunner

    if entry.engine == "echo":
        return EchoRunner(entry.context_length, entry.chat.tool_parser, entry.chat.reasoning_parser)
    return NullRunner(entry.context_length)


def _chat(entry: ModelEntry, model_path: Path):
    if entry.distributed is not None:  # rank 0 of a sharded model (the others never get here)
        from .distributed import build_rank0_runner

        return build_rank0_runner(entry, model_path)
    from ..model.cache.prefix_store import store_for
    from .build_mlx import entry_runner

    return entry_runner(entry, model_path, prefix_store=store_for(entry.name, model_path, entry.cache.prefix_disk_mb))


# The runner of each kind; the null and echo engines stand in for a generating model.
STAND_INS = ("null", "echo")
BUILDERS = {
    **dict.fromkeys(ENCODER_KINDS, _encoder),
    ModelKind.AUDIO: _speech,
    ModelKind.SPEECH: _speech,
    ModelKind.VISION: _vision,
    ModelKind.IMAGE: _image,
    ModelKind.CHAT: _chat,
    **dict.fromkeys(STAND_INS, _null),
}


def build_runner(entry: ModelEntry, model_path: Path):
    stand_in = entry.kind in CHAT_KINDS and entry.engine in STAND_INS
    return BUILDERS[entry.engine if stand_in else entry.kind](entry, model_path)


def unservable(error: Exception) -> bool:
    """Whether a load failure is the model's own (restarting would fail the same way), not
    a passing condition such as memory."""
    from ..model.model_info import UnservableModel

    deterministic = (UnservableModel, ValueError, KeyError, AttributeError, TypeError, NotImplementedError, ImportError)
    return isinstance(error, (*deterministic, FileNotFoundError))


def resolve_max_num_seqs(entry: ModelEntry, model_path: Path) -> tuple[ModelEntry, SeqsChoice]:
    """The entry with max_num_seqs filled in (models.yaml's, else worker/model/memory/capacity.py's formula)."""
    if entry.kind not in CHAT_KINDS or entry.engine != "mlx":  # no KV rows to size: the minimum
        choice = choose_max_num_seqs(entry.max_num_seqs, Path("/nonexistent"), 0)
    else:
        ram = total_memory_bytes()
        kv = entry.cache
        choice = choose_max_num_seqs(entry.max_num_seqs, model_path, ram, kv.kv_bits, kv.kv_group_size)
    return dataclasses.replace(entry, max_num_seqs=choice.value), choice


def build_scheduler(
    entry: ModelEntry,
    runner,
    preprocessor: Preprocessor | None = None,
    seqs: SeqsChoice | None = None,
    hang_timeout_s: float | None = None,
):
    """The policy over the runner: input batching for encoders, sequences for the rest.
    preprocessor: where requests are templated and tokenized (off the engine thread).
    hang_timeout_s: the gateway's watchdog bound, which paces prefill steps."""
    if entry.kind in ENCODER_KINDS:
        from ..schedule.embeddings import EmbedScheduler

        return EmbedScheduler(
            runner,
            max_batch_size=entry.encoder.max_batch_inputs,
            max_batch_tokens=entry.encoder.max_batch_tokens,
            max_queue=entry.max_queue,
            preprocessor=preprocessor,
        )
    if entry.kind == ModelKind.AUDIO:
        from ..schedule.transcription import AudioScheduler

        return AudioScheduler(runner, max_rows=entry.max_num_seqs, max_queue=entry.max_queue)
    if entry.kind == ModelKind.SPEECH:
        from ..schedule.speech import SpeechScheduler

        return SpeechScheduler(runner, max_queue=entry.max_queue)
    if entry.kind == ModelKind.IMAGE:
        from ..schedule.images import ImageScheduler

        return ImageScheduler(runner, max_queue=entry.max_queue)
    from ..schedule.prefill_plan import PrefillPace
    from ..schedule.scheduler import Scheduler

    return Scheduler(
        runner,
        max_num_seqs=entry.max_num_seqs,
        max_queue=entry.max_queue,
        policy=entry.max_tokens_policy,
        preprocessor=preprocessor,
        prefill_budget=entry.prefill_step_size,
        capacity=seqs.as_dict() if seqs else None,
        pace=PrefillPace.for_hang_timeout(hang_timeout_s),
        kv=kv_budget_for(entry, runner),
    )


def kv_budget_for(entry: ModelEntry, runner):
    """The KV budget rows are admitted within, measured now that the weights are loaded
    (worker/model/memory/kv_budget.py); None where rows are admitted by count (other engines, and sharded
    models, whose ranks must keep identical prefix caches)."""
    from ..model.memory.kv_budget import KVBudget, activations_of, measure_budget
    from ..schedule.prefill_plan import IDLE_BUDGET_FACTOR

    try:
        profile = runner.kv_profile() if entry.distributed is None else None
    except Exception as e:  # a family whose forward the probe cannot drive: count rows as before
        log.warning("measuring the KV per token failed (%r): rows are admitted by count only", e, exc_info=e)
        return None
    if profile is None:
        return None
    bank = getattr(runner, "adapters", None)
    reserve = None if bank is None else bank.max_bytes  # models.yaml adapter_memory_mb; None: by count
    measured = less_adapters(measure_budget(entry.cache.kv_memory_mb, total_memory_bytes()), entry, reserve)
    budget = KVBudget(profile, measured)
    if bank is not None and reserve is None and entry.cache.kv_memory_mb is None:
        # Bounded by count, adapters take what they weigh from the same memory, as they load.
        budget.taken = bank.resident_bytes
        if entry.adapters:
            budget.measured.source += ", less resident adapters"
    # A measured budget is what the machine leaves: a prefill step's activations come out of
    # it too. A kv_memory_mb set outright is the KV's own, as set.
    model = getattr(runner, "model", None)
    if model is not None and entry.cache.kv_memory_mb is None:
        budget.activations = activations_of(model)
    budget.set_chunk(entry.prefill_step_size * IDLE_BUDGET_FACTOR)  # as the scheduler will
    log.info("KV budget %d MiB (%s); %s", budget.budget_bytes >> 20, budget.measured.source, profile.as_dict())
    if budget.tokens_alone() < min(runner.context_length, SHORT_KV_BUDGET_TOKENS):
        log.warning(
            "the KV budget holds at most %d tokens for one request (prompt + max_tokens): longer ones "
            "are refused; give the worker more memory or set kv_memory_mb",
            budget.tokens_alone(),
        )
    return budget


def less_adapters(measured, entry: ModelEntry, reserve: int | None):
    """A measured KV budget less the adapters' byte bound (reserve): adapters load on first use,
    after the budget is measured from what the weights left, and take from the same memory. A
    kv_memory_mb set outright is the KV's own and stays as set."""
    if reserve is None or entry.cache.kv_memory_mb is not None:
        return measured
    budget = max(0, measured.bytes - reserve)
    return dataclasses.replace(measured, bytes=budget, source=f"{measured.source}, less adapter_memory_mb")


def serve(
    endpoint: str,
    entry: ModelEntry,
    model_path: Path,
    *,
    worker_id: str | None = None,
    heartbeat_s: float = 1.0,
    liveness: int = 5,
    orphan_after: float | None = 15.0,
    hang_timeout_s: float | None = None,
) -> int:
    hello = {
        "worker_id": worker_id or uuid.uuid4().hex,
        "model": entry.name,
        "kind": entry.kind,
        "pid": os.getpid(),
        "secret": os.environ.get("MLXGW_SECRET", ""),
    }
    link = WorkerLink(endpoint, hello, heartbeat_s=heartbeat_s, liveness=liveness, orphan_after=orphan_after)
    link.load_probe = LoadProgress(model_path).snapshot
    link.start()
    started = time.monotonic()
    entry, seqs = resolve_max_num_seqs(entry, model_path)
    try:
        runner = build_runner(entry, model_path)
    except Exception as e:  # any load failure is reported, then the process exits non-zero
        log.exception("model load failed")
        link.send(
            p.LOAD_FAILED,
            error=ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"loading {entry.name} failed: {e}").to_wire(),
        )
        time.sleep(0.5)  # let the link flush
        link.close()
        return p.EXIT_UNSERVABLE if unservable(e) else 3
    info = {
        "context_length": runner.context_length,
        "max_num_seqs": entry.max_num_seqs,
        "max_queue": entry.max_queue,
        "load_seconds": round(time.monotonic() - started, 3),
        "engine": entry.engine,
    }
    if entry.kind in ENCODER_KINDS:
        info["dimensions"] = runner.dim
    link.hello["info"] = info
    start_helper_child()  # tests only: a helper process's memory under the worker
    link.state = "ready"
    link.send(p.READY, info=info)
    # One thread: HF tokenizers may refuse concurrent use ("Already borrowed"); a slow template
    # holds the next request back at most its time budget.
    preprocessor = Preprocessor(threads=1)
    link.busy_probes.append(preprocessor.busy_s)  # the watchdog covers preparation too
    if entry.distributed is None and entry.kind in CHAT_KINDS and runner.supports_layer_progress:
        from .step_progress import install

        # a long prefill step is slow, not hung: its layer groups mark progress once steps are long
        long_step_s = (hang_timeout_s or 120.0) / LONG_STEP_DIVISOR
        layer_progress = install(runner.model, link.mark_progress, long_step_s)
    else:
        layer_progress = None
    engine = Engine(link, runner, build_scheduler(entry, runner, preprocessor, seqs, hang_timeout_s), preprocessor)
    engine.layer_progress = layer_progress
    signal.signal(signal.SIGTERM, lambda *_: setattr(engine, "draining", True))
    # After READY (readiness is not delayed); requests that arrive meanwhile wait in the link.
    restore_into(runner)
    engine.run()
    preprocessor.close()
    save_from(runner)  # a graceful stop (a crash never gets here: its KV is not trusted)
    link.send(p.BYE)
    time.sleep(0.1)
    link.close()
    return 0


class _DropTokenLengthWarning(logging.Filter):
    """transformers warns "Token indices sequence length is longer than the specified maximum"
    whenever a prompt is tokenized past the tokenizer's model_max_length: a line untied to any
    request, about a limit the worker checks itself (a clear 400 naming the lengths)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token indices sequence length" not in record.getMessage()


def quiet_library_warnings() -> None:
    drop = _DropTokenLengthWarning()
    for name in ("transformers", "transformers.tokenization_utils_base", "transformers.tokenization_utils_fast"):
        logging.getLogger(name).addFilter(drop)
    try:  # transformers' own handler, where its records end up
        from transformers.utils import logging as hf_logging

        for handler in hf_logging.get_logger().handlers:
            handler.addFilter(drop)
    except Exception:  # no transformers, or another version's layout: the logger filters stay
        pass


def run_worker(
    connect: str,
    model: str,
    model_path: str | None,
    entry_json: str,
    worker_id: str | None,
    heartbeat: float,
    liveness: int,
    orphan_after: float,
    hang_timeout: float | None = None,
) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s worker[{model}] %(levelname)s %(message)s"
    )
    quiet_library_warnings()
    entry_data = {**json.loads(entry_json), "name": model}
    entry = from_mapping(ModelEntry, entry_data, f"worker {model}")
    from ...shared.paths import models_dir

    path = Path(model_path) if model_path else entry.model_path(models_dir())
    if entry.distributed is not None:
        from .distributed import rank_from_env, serve_follower

        if rank_from_env() > 0:  # a follower rank: no gateway link (worker/process/lockstep.py)
            # The same batch size as rank 0 (same formula, same machine; remote ranks need
            # max_num_seqs set in models.yaml: shared/config._check_distributed).
            entry, _ = resolve_max_num_seqs(entry, path)
            sys.exit(serve_follower(entry, path))
    sys.exit(
        serve(
            connect,
            entry,
            path,
            worker_id=worker_id,
            heartbeat_s=heartbeat,
            liveness=liveness,
            orphan_after=orphan_after or None,
            hang_timeout_s=hang_timeout,
        )
    )
