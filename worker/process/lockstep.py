"""The lockstep engine of a sharded model: rank 0 decides, every rank computes.

Rank 0 runs the ordinary engine and scheduler over a LockstepRunner. Everything that
changes the batch (insert, remove, prefix-cache clear) is applied on rank 0 at once and
recorded; before each BatchGenerator step the record is broadcast to the other ranks, which
replay it on their own runner and then run the same step on their shard. Ranks therefore
hold the same batch, the same uids and the same prefix-cache entries, and the model's
collectives (pipeline send/recv, tensor all_sum) meet. Only rank 0 tokenizes, applies
templates, parses output and sends events; the others see token ids only.

The broadcast is two collectives, as mlx_lm.server's distributed mode does it: all_sum of
the payload length, then all_sum of the payload bytes (rank 0 contributes them, the others
zeros). A lost peer makes the next collective raise RuntimeError on every survivor."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import random
import time
from typing import Any

import mlx.core as mx
import msgpack
import numpy as np

from ...shared.protocol import SamplingParams
from ..model.interfaces import Row

log = logging.getLogger(__name__)

GATHER_INTERVAL_S = 1.0  # rank memory is gathered (and idle peers checked) this often


def _settle() -> None:
    """Wait for the forward pass BatchGenerator left running: it async_evals the next
    tokens on mlx-lm's generation stream, and the model's own send/recv/all_gather share the
    ring's connections with ours; a collective issued meanwhile interleaves with them and
    corrupts both (measured: wrong tokens from the second step on)."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


class Channel:
    """Rank 0 -> every rank messages, and a gather of a few integers per rank."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = group.rank()

    def _round(self, data: bytes) -> bytes:
        _settle()
        length = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=self.group, stream=mx.cpu)
        n = int(length.item())
        if self.rank == 0:
            buf = mx.array(np.frombuffer(data, dtype=np.uint8))
        else:
            buf = mx.zeros((n,), dtype=mx.uint8)
        out = mx.distributed.all_sum(buf, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return bytes(np.array(out, copy=False))

    def send(self, msg: dict) -> None:
        self._round(msgpack.packb(msg))

    def receive(self) -> dict:
        return msgpack.unpackb(self._round(b""), strict_map_key=False)

    def gather(self, values: list[int]) -> list[list[int]]:
        _settle()
        row = mx.array([values], dtype=mx.int64)
        return mx.distributed.all_gather(row, group=self.group, stream=mx.cpu).tolist()


def sampling_wire(sampling: SamplingParams) -> dict:
    return dataclasses.asdict(sampling)


class LockstepRunner:
    """Rank 0's runner: a ShardedRunner whose batch changes are replayed on every rank.
    Everything it does not define (encode, text, tokenizer, vocab_size, ...) is the inner
    runner's."""

    def __init__(self, inner: Any, channel: Channel, describe: dict):
        self.inner = inner
        self.channel = channel
        self.describe = describe  # strategy, ranks, backend: reported in stats
        self._pending: list[list] = []
        self._last_gather = 0.0
        self._rank_memory: list[list[int]] = []
        self.broken: BaseException | None = None
        atexit.register(self.finish)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # -- batch changes, recorded for the other ranks ----------------------------------
    def insert(self, row: Row):
        """The row's namespace goes to every rank, whose caches must find what rank 0 found."""
        # A constraint (grammar, reasoning budget) changes logits on rank 0 only: the other
        # ranks then take rank 0's token instead of sampling their own.
        sync = row.constraint is not None
        self.inner.sync_next = sync
        uid, cached = self.inner.insert(row)
        wire = [list(row.prompt), row.max_tokens, sampling_wire(row.sampling), cached, row.keep_prompt, sync, uid]
        self._pending.append(["insert", *wire, row.namespace])
        return uid, cached

    def remove(self, uids: list[int]) -> None:
        self._pending.append(["remove", list(uids)])
        self.inner.remove(uids)

    def cache_clear(self) -> None:
        self._pending.append(["cache_clear"])
        self.inner.cache_clear()

    def set_prefill_chunk(self, tokens: int) -> None:
        # The scheduler's per-step prefill budget decides how far each prompt gets in a step;
        # every rank must read the same chunk or their batches stop matching.
        self._pending.append(["prefill_chunk", int(tokens)])
        self.inner.set_prefill_chunk(tokens)

    def step(self):
        if self.broken is not None:
            raise RuntimeError(f"a rank of the group was lost: {self.broken}")
        seed = random.getrandbits(31)
        self._broadcast(step=True, seed=seed)
        mx.random.seed(seed)  # unseeded sampling draws the same numbers on every rank
        return self.inner.step()

    def _broadcast(self, **flags: Any) -> None:
        ops, self._pending = self._pending, []
        self.channel.send({"ops": ops, **flags})

    # -- the group's memory -------------------------------------------------------------
    def stats(self) -> dict:
        stats = dict(self.inner.stats())
        now = time.monotonic()
        if self.broken is None and now - self._last_gather >= GATHER_INTERVAL_S:
            self._last_gather = now
            try:
                self._broadcast(gather=True)
                self._rank_memory = self.channel.gather(rank_memory(self.inner))
            except RuntimeError as e:  # a peer is gone: the next step ends the requests
                log.error("the group lost a rank: %s", e)
                self.broken = e
        if self._rank_memory:
            rss = [int(r[0]) for r in self._rank_memory]
            stats["rss_bytes"] = sum(rss)  # the residency budget counts the whole group
            stats["rank_rss_bytes"] = rss
            stats["rank_param_bytes"] = [int(r[1]) for r in self._rank_memory]
        stats["distributed"] = self.describe
        return stats

    def finish(self) -> None:
        """Tell the other ranks to exit (at rank 0's exit; a dead group just raises)."""
        if self.broken is None:
            try:
                self._broadcast(exit=True)
            except Exception:  # the group is already broken: the other ranks see it too
                pass
            self.broken = RuntimeError("finished")


def rank_memory(runner: Any) -> list[int]:
    import psutil

    return [psutil.Process().memory_info().rss, runner.param_bytes]


def follow(runner: Any, channel: Channel) -> int:
    """A rank other than 0: replay rank 0's changes and step with it until told to exit.
    A lost peer raises RuntimeError out of here (the process exits non-zero)."""
    while True:
        msg = channel.receive()
        for op in msg.get("ops", []):
            _apply(runner, op)
        if msg.get("gather"):
            channel.gather(rank_memory(runner))
        if msg.get("exit"):
            return 0
        if msg.get("step"):
            mx.random.seed(int(msg["seed"]))
            runner.step()


def _apply(runner: Any, op: list) -> None:
    kind = op[0]
    if kind == "insert":
        prompt, max_tokens, sampling, cached, keep_prompt, sync, uid, namespace = op[1:]
        runner.sync_next = sync
        runner.forced_cached = cached
        row = Row(prompt, max_tokens, SamplingParams(**sampling), keep_prompt=keep_prompt, namespace=namespace)
        got, _ = runner.insert(row)
        runner.forced_cached = None
        if got != uid:
            raise RuntimeError(f"rank diverged from rank 0: sequence uid {got}, rank 0 has {uid}")
    elif kind == "remove":
        try:
            runner.remove(op[1])
        except Exception as e:  # rank 0 failed the same way and went on
            log.warning("removing %s failed: %r", op[1], e)
    elif kind == "cache_clear":
        runner.cache_clear()
    elif kind == "prefill_chunk":
        runner.set_prefill_chunk(op[1])
    else:
        raise RuntimeError(f"unknown lockstep operation {kind!r}")
