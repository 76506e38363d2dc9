"""One model over several ranks on MLX's distributed layer (models.yaml `distributed:`).

Every rank is a worker process started with MLX_HOSTFILE (a JSON list of host:port lists)
and MLX_RANK. Rank 0 alone speaks to the gateway (link, heartbeats, events) and runs the
engine over a LockstepRunner (worker/process/lockstep.py); the other ranks follow it. Before any
rank waits on a peer, the configuration is checked against the model's architecture, so a
refused configuration is a clear load error, not a hang."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from ...shared.model_sections import DistributedConfig, ModelEntry, SpeculativeConfig
from ..model.cache.prefix_cache import PrefixCache
from ..model.runners.mlx_runner import MLXRunner
from .build_mlx import entry_runner

log = logging.getLogger(__name__)

BACKEND_HELP = {
    "ring": "the ring backend connects over TCP: check that every host:port in the hostfile is "
    "reachable from the other ranks and that each rank was started",
    "jaccl": "JACCL needs macOS 26.2 or later, Thunderbolt 5 cables between the Macs, RDMA enabled "
    "(`rdma_ctl enable` in recovery mode) and an MLX build with JACCL; use backend: ring elsewhere",
    "mpi": "MPI needs an MPI library (OpenMPI: `brew install open-mpi` or `apt install libopenmpi-dev`) "
    "and ranks started by mpirun; mlxgw starts ranks itself, so use backend: ring",
}


class ShardingError(ValueError):
    """A configuration this model or this machine cannot run: said before any rank waits."""


def rank_from_env() -> int:
    return int(os.environ.get("MLX_RANK", "0"))


# -- checks before start ----------------------------------------------------------------------
def check_support(model_path: Path, d: DistributedConfig) -> None:
    """Refuse a strategy the architecture lacks, or a split its shapes do not allow."""
    from mlx_lm.utils import _get_classes

    config = json.loads((model_path / "config.json").read_text())
    arch = config.get("model_type", "?")
    try:
        model_cls, _ = _get_classes(config)
    except ValueError as e:
        raise ShardingError(f"model type {arch!r} is not supported by mlx-lm: {e}") from None
    if d.strategy == "pipeline":
        if not _has_pipeline(model_cls):
            raise ShardingError(
                f"strategy pipeline is not available for {arch!r} models in mlx-lm (no model.pipeline); "
                "use strategy: tensor if its head counts divide by the ranks"
            )
        layers = int(config.get("num_hidden_layers", 0))
        if layers < d.ranks:
            raise ShardingError(f"strategy pipeline: {layers} layers cannot be split over {d.ranks} ranks")
        return
    if not hasattr(model_cls, "shard"):
        raise ShardingError(f"strategy tensor is not available for {arch!r} models in mlx-lm (no model.shard)")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(value, int) and value % d.ranks:
            raise ShardingError(
                f"strategy tensor: {name} = {value} does not divide by {d.ranks} ranks "
                f"(use a rank count that divides it, or strategy: pipeline)"
            )


def _has_pipeline(model_cls: type) -> bool:
    from mlx_lm.models.pipeline import PipelineMixin

    module = sys.modules[model_cls.__module__]
    return any(isinstance(v, type) and issubclass(v, PipelineMixin) for v in vars(module).values())


# -- forming the group ----------------------------------------------------------------------
def init_group(d: DistributedConfig) -> Any:
    """Join the group (blocks until every rank has joined). The caller has armed an alarm:
    MLX's accept() holds the interpreter, so no Python timer could end the wait."""
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True, backend=d.backend)
    except Exception as e:
        raise ShardingError(f"the {d.backend} backend could not initialise: {e}; {BACKEND_HELP[d.backend]}") from None
    if group.size() != d.ranks:
        raise ShardingError(f"the group has {group.size()} ranks, the entry asks for {d.ranks}")
    return group


def arm_start_alarm(d: DistributedConfig) -> None:
    """SIGALRM with its default action ends this process if the group has not formed and
    loaded within start_timeout_s (the supervisor then ends the other ranks)."""
    log.info(
        "rank %d: joining a group of %d (%s backend); waiting up to %g s for the other ranks",
        rank_from_env(),
        d.ranks,
        d.backend,
        d.start_timeout_s,
    )
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(d.start_timeout_s)))


def disarm_start_alarm() -> None:
    signal.alarm(0)


# -- loading a shard ---------------------------------------------------------------------------
def shard_loader(group: Any, strategy: str):
    """A loader for MLXRunner: mlx_lm.utils.sharded_load's sharding, from a local folder
    (sharded_load itself wants a model.safetensors.index.json, which single-file models lack)."""

    def load(path: str, return_config: bool = True):
        import mlx.core as mx
        from mlx_lm.utils import load_model, load_tokenizer

        model, config = load_model(Path(path), lazy=True, strict=False)
        if strategy == "tensor":
            model.shard(group)
        else:
            model.model.pipeline(group)
        mx.eval(model.parameters())  # only this rank's weights are read
        tokenizer = load_tokenizer(Path(path), {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id"))
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank has loaded
        return model, tokenizer, config

    return load


class ShardedRunner(MLXRunner):
    """MLXRunner on one shard, with two hooks the lockstep needs: a sequence can take rank 0's
    token (sync_next, for constrained sequences), and a follower's prefix-cache lookup covers
    exactly as many tokens as rank 0's did (forced_cached)."""

    supports_prompt_logprobs = False  # an extra forward pass on rank 0 alone would hang the group
    supports_shared_prefill = False  # an early publish on rank 0 alone would split the ranks' caches

    def __init__(self, *, group: Any, **parts: Any):
        """parts: MLXRunner's, built over this rank's shard (load_sharded_runner)."""
        super().__init__(**parts)
        self.group = group
        self.sync_next = False
        self.forced_cached: int | None = None
        self.param_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.prefix_cache = _ExactPrefixCache(self.prefix_cache.max_bytes, self)
        self.prefix_cache.describe(self._fresh_cache())  # as MLXRunner's: what its blocks assemble into
        # BatchGenerator.insert goes through insert_segments (positionally), as MLXRunner does.
        plain_insert = self.generator.insert_segments

        def insert_segments(segments, max_tokens=None, caches=None, all_tokens=None, samplers=None, *rest, **kw):
            if self.sync_next and samplers:
                samplers = [_synced(s, group) for s in samplers]
            return plain_insert(segments, max_tokens, caches, all_tokens, samplers, *rest, **kw)

        self.generator.insert_segments = insert_segments


def _synced(sampler, group):
    """Rank 0's draw, on every rank: all_sum of rank 0's tokens and the others' zeros."""
    import mlx.core as mx

    leader = group.rank() == 0

    def sample(logprobs):
        if leader:
            tokens = sampler(logprobs).astype(mx.uint32)
        else:
            tokens = mx.zeros((logprobs.shape[0],), dtype=mx.uint32)
        return mx.distributed.all_sum(tokens, group=group, stream=mx.cpu)

    return sample


class _ExactPrefixCache(PrefixCache):
    """A follower's prefix cache: the lookup is cut to the length rank 0 found."""

    def __init__(self, max_bytes: int, runner: ShardedRunner):
        super().__init__(max_bytes)
        self.runner = runner

    def longest_match(self, prompt: list[int]) -> tuple[list | None, int]:
        forced = self.runner.forced_cached
        if forced is None:
            return super().longest_match(prompt)
        if forced == 0:
            return None, 0
        cache, covered = super().longest_match(prompt[: forced + 1])
        if covered != forced:
            raise RuntimeError(f"prefix cache diverged: rank 0 reused {forced} tokens, this rank {covered}")
        return cache, covered


# -- entry points ---------------------------------------------------------------------------------
def load_sharded_runner(model_path: Path, group: Any, strategy: str, entry: ModelEntry):
    """This rank's shard of the model, as a ShardedRunner, built as any entry's MLX runner."""
    # Speculation pauses and resumes on measured step times, which differ between ranks:
    # ranks would take different steps and leave lockstep. Sharded models never speculate;
    # their KV stays unquantized and FIM as the tokenizer says, as they always have.
    off = SpeculativeConfig(mode="off")
    entry = replace(entry, speculative=off, cache=replace(entry.cache, kv_bits=None), fim=None)
    return entry_runner(entry, model_path, loader=shard_loader(group, strategy), runner_cls=ShardedRunner, group=group)


def build_rank0_runner(entry: ModelEntry, model_path: Path):
    """Rank 0's runner (called by worker/main.build_runner): checks, group, shard, lockstep."""
    from .lockstep import Channel, LockstepRunner

    d = entry.distributed
    assert d is not None
    check_support(model_path, d)
    arm_start_alarm(d)
    try:
        group = init_group(d)
        inner = load_sharded_runner(model_path, group, d.strategy, entry)
    finally:
        disarm_start_alarm()
    return LockstepRunner(inner, Channel(group), {**asdict(d), "rank": 0})


def serve_follower(entry: ModelEntry, model_path: Path) -> int:
    """A rank other than 0: no gateway link; load the shard and follow rank 0 until it exits."""
    from .lockstep import Channel, follow

    d = entry.distributed
    assert d is not None
    rank = rank_from_env()
    try:
        check_support(model_path, d)  # rank 0 reports it; here it only ends this rank quietly
        arm_start_alarm(d)
        group = init_group(d)
        runner = load_sharded_runner(model_path, group, d.strategy, entry)
        disarm_start_alarm()
    except ShardingError as e:
        log.error("rank %d: %s", rank, e)
        return 3
    log.info("rank %d of %s ready (%s, %d bytes of parameters)", rank, entry.name, d.strategy, runner.param_bytes)
    try:
        return follow(runner, Channel(group))
    except RuntimeError as e:
        log.error("rank %d: the group failed: %s", rank, e)
        return 4


def run_remote_rank(rank: int, model: str, model_path: str | None, entry_json: str) -> None:
    """`mlxgw worker --rank N`: a rank started by hand on another host, rejoining each new
    group (a group ends with every restart or unload of rank 0, and MLX cannot re-form a
    group in the same process, so each group gets a fresh child process). Its hostfile is the
    entry's distributed.hosts, the same on every host."""
    import subprocess
    import time

    hosts = (json.loads(entry_json).get("distributed") or {}).get("hosts") or []
    if not 0 < rank < len(hosts):
        raise SystemExit(f"--rank {rank}: the entry's distributed.hosts must list this rank (it has {len(hosts)})")
    env = dict(os.environ, MLX_RANK=str(rank))
    if "MLX_HOSTFILE" not in env:
        path = Path(tempfile.gettempdir()) / f"mlxgw-rank{rank}-{os.getpid()}.hosts.json"
        path.write_text(json.dumps([[h] for h in hosts]))
        env["MLX_HOSTFILE"] = str(path)
    cmd = [sys.executable, "-m", "mlxgw.worker", "--model", model, "--entry", entry_json]
    cmd += ["--model-path", model_path] if model_path else []
    while True:
        code = subprocess.run(cmd, env=env).returncode
        print(f"rank {rank}: the group ended (exit code {code}); joining the next one", file=sys.stderr, flush=True)
        time.sleep(2)


def _check_main(argv: list[str]) -> int:
    """`python -m mlxgw.worker.process.distributed MODEL_PATH DISTRIBUTED_JSON`: the gateway's check
    before it starts any rank (it never imports MLX itself). Prints the refusal, exits 3."""
    try:
        check_support(Path(argv[0]), DistributedConfig(**json.loads(argv[1])))
    except ShardingError as e:
        print(e)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
