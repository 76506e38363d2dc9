"""State checkpoints: prefix reuse for the layers whose cache cannot be cut back.

A plain KV cache holding tokens [0, n) can be trimmed to any shorter prefix. A recurrent
layer's state (gated DeltaNet, Mamba, short convolutions: mlx-lm's ArraysCache) is a summary
of all n tokens, and a sliding-window layer (RotatingKVCache) has overwritten what fell out of
its window: neither can be taken back to position p < n. mlx-lm's prompt cache therefore
reuses nothing on these families unless a new prompt extends a stored one exactly (mlx-lm
issue #980).

As llama.cpp's context checkpoints and vLLM's hybrid "align" mode do, the worker keeps a
copy of those layers' state at known positions of a prompt while prefilling it (prefill
chunk boundaries, message boundaries, just before the prompt's last token). A stored entry
(the whole cache at its end) plus its checkpoints can then serve any prompt that shares a
prefix with it: the trimmable layers come from the entry, cut to position p, the others from
the deepest checkpoint at p <= the shared prefix. A checkpoint holds only the non-trimmable
layers (None for a KV layer), so its size is a recurrent state or one window, not the prefix.

A snapshot is a list with one item per layer: None (a trimmable layer: take it from the
entry), a tuple of per-sub-cache items (a CacheList, as falcon_h1 has), or a private copy
of the layer's cache."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

log = logging.getLogger(__name__)

TRIMMABLE = (KVCache, QuantizedKVCache)
# Positions kept per entry: message boundaries first, then the deepest grid positions.
MAX_CHECKPOINTS = 24


def trimmable(layer) -> bool:
    """Whether this layer's cache can always be cut back to a shorter prefix."""
    if isinstance(layer, CacheList):
        return all(trimmable(c) for c in layer.caches)
    return isinstance(layer, TRIMMABLE)


def needs_checkpoints(cache: list) -> bool:
    return any(not trimmable(c) for c in cache)


def _copy_arrays(layer):
    """A deep copy whose arrays are new, compact buffers (a row sliced out of a batch
    would otherwise keep the whole batch's buffer alive behind a small view)."""
    out = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, mx.array):
            setattr(out, name, mx.contiguous(value) + 0 if value.size else value)
        elif isinstance(value, list):
            setattr(out, name, [mx.contiguous(v) + 0 if isinstance(v, mx.array) else v for v in value])
    return out


def snapshot_layer(layer):
    if isinstance(layer, CacheList):
        return tuple(snapshot_layer(c) for c in layer.caches)
    if isinstance(layer, TRIMMABLE):
        return None
    return _copy_arrays(layer)


def snapshot(cache: list) -> list:
    """The non-trimmable layers of one sequence's cache (already extracted from the batch)."""
    snap = [snapshot_layer(c) for c in cache]
    mx.eval([_arrays(s) for s in snap])
    return snap


def _arrays(item) -> list:
    if item is None:
        return []
    if isinstance(item, tuple):
        return [a for sub in item for a in _arrays(sub)]
    out = []
    for value in vars(item).values():
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, list):
            out.extend(v for v in value if isinstance(v, mx.array))
    return out


def nbytes(snap: list) -> int:
    return sum(a.nbytes for item in snap for a in _arrays(item))


def _restore_layer(item, entry_layer, cut: int):
    if item is None:
        layer = copy.deepcopy(entry_layer)
        layer.trim(cut)
        return layer
    if isinstance(item, tuple):
        return CacheList(*(_restore_layer(s, e, cut) for s, e in zip(item, entry_layer.caches)))
    return copy.deepcopy(item)


def restore(snap: list, entry_cache: list, entry_length: int, position: int) -> list:
    """A private cache at `position`: KV layers cut from the entry, the rest from the snapshot."""
    cut = entry_length - position
    return [_restore_layer(item, layer, cut) for item, layer in zip(snap, entry_cache)]


@dataclass
class Checkpoints:
    """The checkpoints of one stored entry: position -> snapshot (positions < its length)."""

    tokens: list[int]
    states: dict[int, list] = field(default_factory=dict)
    priority: set[int] = field(default_factory=set)  # message boundaries: kept first
    nbytes: int = 0

    def add(self, position: int, snap: list, boundary: bool = False) -> None:
        if position <= 0 or position > len(self.tokens):
            return
        old = self.states.get(position)
        if old is not None:
            self.nbytes -= nbytes(old)
        self.states[position] = snap
        self.nbytes += nbytes(snap)
        if boundary:
            self.priority.add(position)
        self._bound()

    def merge(self, other: Checkpoints) -> None:
        """Take the checkpoints of an entry this one extends (a prefix of its tokens)."""
        for position, snap in other.states.items():
            if position not in self.states:
                self.add(position, snap, position in other.priority)

    def for_entry(self, tokens: list[int]) -> Checkpoints:
        """These checkpoints, for an entry whose tokens begin with this prompt."""
        return Checkpoints(tokens, dict(self.states), set(self.priority), self.nbytes)

    def best(self, limit: int) -> int | None:
        """The deepest checkpoint position <= limit."""
        positions = [p for p in self.states if p <= limit]
        return max(positions) if positions else None

    def _bound(self) -> None:
        while len(self.states) > MAX_CHECKPOINTS:
            grid = sorted(p for p in self.states if p not in self.priority) or sorted(self.states)
            # Drop the shallowest grid position: deeper ones resume more of a prompt.
            victim = grid[0]
            self.nbytes -= nbytes(self.states.pop(victim))
            self.priority.discard(victim)


def checkpoint_positions(prompt: list[int], start: int, boundaries: list[int], interval: int) -> list[int]:
    """Where to checkpoint a prompt whose first `start` tokens are cached: the message
    boundaries, a grid every `interval` tokens, and just before the last token."""
    end = len(prompt) - 1
    grid = range(((start // interval) + 1) * interval, end, interval) if interval > 0 else []
    return sorted({p for p in (*boundaries, *grid, end) if start < p <= end})


def segments(prompt: list[int], start: int, positions: list[int]) -> list[list[int]]:
    """prompt[start:] cut at positions (BatchGenerator stops prefill at each cut)."""
    out, prev = [], start
    for p in positions:
        if p > prev:
            out.append(prompt[prev:p])
            prev = p
    out.append(prompt[prev:])
    return [s for s in out if s]


def row_snapshot(batch_cache: list, row: int) -> list:
    """The non-trimmable layers of one row of a batch's cache (between steps)."""
    from mlx_lm.models.cache import BatchKVCache

    def layer(c):
        if isinstance(c, (BatchKVCache, *TRIMMABLE)):
            return None
        if isinstance(c, CacheList):
            return tuple(layer(sub) for sub in c.caches)
        return _copy_arrays(c.extract(row))

    snap = [layer(c) for c in batch_cache]
    mx.eval([_arrays(s) for s in snap])
    return snap


def take_checkpoints(batch, prompt_responses, rows: dict) -> None:
    """After a prefill step of a PromptProcessingBatch: checkpoint each row that stopped at
    the end of a segment (rows: uid -> the runner's Row, with its Checkpoints and boundaries)."""
    for r in prompt_responses:
        marks = rows[r.uid].checkpoints if r.uid in rows else None
        if not r.end_of_segment or r.end_of_prompt or marks is None or r.uid not in batch.uids:
            continue
        row = batch.uids.index(r.uid)
        position = len(batch.tokens[row])
        try:
            snap = row_snapshot(batch.prompt_cache, row)
        except Exception:  # a checkpoint only saves time later: never fail the step for one
            log.exception("state checkpoint at %d skipped", position)
            continue
        marks.add(position, snap, position in rows[r.uid].boundaries)


# Tokens that open a message in the chat templates of the families served: a checkpoint just
# before each one lets a prompt that shares the system prompt (and tools), or the turns so
# far, resume there even when what follows differs.
TURN_OPENERS = (
    "<|im_start|>",
    "<start_of_turn>",
    "<|turn>",
    "<|start_header_id|>",
    "<|start|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "[INST]",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<|User|>",
    "<|Assistant|>",
)


def turn_opener_ids(tokenizer) -> frozenset[int]:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return frozenset(vocab[t] for t in TURN_OPENERS if t in vocab)


def message_boundaries(prompt: list[int], openers: frozenset[int]) -> list[int]:
    """Positions just before each message opener (the first one excluded: nothing before it)."""
    return [i for i, t in enumerate(prompt) if i > 0 and t in openers]


# -- on disk (worker/model/cache/block_disk.py) --------------------------------------------------------------
def to_layout(marks: Checkpoints, layers: int) -> tuple[dict, list]:
    """Checkpoints as JSON plus the cache layers it points into, stored after the entry's
    own `layers` layers: {"layers": n, "at": [[position, boundary, items], ...]}, where an item
    is null (a KV layer: taken from the entry), an index into the extra layers, or a list of
    those (a CacheList's sub-caches)."""
    extra: list = []

    def item(snap_item):
        if snap_item is None:
            return None
        if isinstance(snap_item, tuple):
            return [item(sub) for sub in snap_item]
        extra.append(snap_item)
        return len(extra) - 1

    at = [[p, int(p in marks.priority), [item(i) for i in snap]] for p, snap in sorted(marks.states.items())]
    return {"layers": layers, "at": at}, extra


def valid_layout(layout, length: int) -> bool:
    if not isinstance(layout, dict) or not isinstance(layout.get("layers"), int) or layout["layers"] <= 0:
        return False
    at = layout.get("at")
    return isinstance(at, list) and all(
        isinstance(m, list) and len(m) == 3 and isinstance(m[0], int) and 0 < m[0] <= length and isinstance(m[2], list)
        for m in at
    )


def from_layout(tokens: list[int], layout: dict, extra: list) -> Checkpoints:
    """Checkpoints rebuilt from a file's layout and extra layers (ValueError if they disagree)."""

    def item(entry):
        if entry is None:
            return None
        if isinstance(entry, list):
            return tuple(item(sub) for sub in entry)
        if not isinstance(entry, int) or not 0 <= entry < len(extra):
            raise ValueError("a checkpoint names a layer the file does not hold")
        return extra[entry]

    out = Checkpoints(list(tokens))
    for position, boundary, items in layout["at"]:
        if len(items) != layout["layers"]:
            raise ValueError("a checkpoint with another number of layers")
        out.add(position, [item(e) for e in items], bool(boundary))
    return out


# Prefill positions between state checkpoints (plus message boundaries and the last token);
# long prompts space them wider so an entry keeps at most about MAX_CHECKPOINTS of them.
CHECKPOINT_INTERVAL = 512


def prompt_segments(
    prompt: list[int], cached: int, turn_openers, junctions: list[int] = ()
) -> tuple[list[list[int]], set[int]]:
    """The uncached prompt, cut where the generator must stop to take a checkpoint, and the
    message boundaries among the cuts (junctions, where it leaves a stored prompt, count as
    boundaries: kept first)."""
    boundaries = message_boundaries(prompt, turn_openers) + list(junctions)
    interval = max(CHECKPOINT_INTERVAL, len(prompt) // MAX_CHECKPOINTS)
    positions = checkpoint_positions(prompt, cached, boundaries, interval)
    return segments(prompt, cached, positions), set(boundaries)
