"""KV in fixed-size token blocks, keyed by the hash chain of their tokens.

As vLLM's automatic prefix caching and SGLang's radix tree do, a stored sequence is a chain
of blocks of BLOCK_TOKENS tokens (the last one may be shorter); a block's key hashes its
parent's key and its own tokens, so two sequences sharing a prefix share the blocks of that
prefix and any number of sessions with the same system prompt hold it once. A block holds,
per layer, the slice of the trimmable layers' KV for its positions (a "piece": None for a
layer that cannot be cut back, a tuple for a CacheList's sub-caches), and the state
checkpoints (worker/model/cache/state_checkpoints.py) taken at positions inside it: what a hybrid or
sliding-window family resumes from.

MLX's attention wants one contiguous KV per row, so a lookup assembles a private cache from
the blocks (a concatenation per layer: cheap beside the prefill it saves). Only leaves are
evicted (recency, hits and the cost to recompute weighed: worker/model/cache/eviction.py),
so a chain never loses a block its descendants need."""

from __future__ import annotations

import copy
import hashlib
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from . import state_checkpoints as sc
from .eviction import Clock

BLOCK_TOKENS = 32  # sessions diverging mid-block duplicate at most this many tokens each


def chain_key(parent: bytes, tokens) -> bytes:
    """A block's key: its parent's key and its own tokens, hashed."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


ROOT = b""


# -- pieces: one block's slice of one layer ------------------------------------------------------
@dataclass
class KVPiece:
    keys: tuple  # one array, or a quantized layer's (data, scales, biases)
    values: tuple

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def cut(self, length: int) -> KVPiece:
        return KVPiece(tuple(a[..., :length, :] for a in self.keys), tuple(a[..., :length, :] for a in self.values))


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _compact(a: mx.array, start: int, end: int) -> mx.array:
    # A new buffer: a view would keep the whole row (or batch) alive behind a small block.
    return mx.contiguous(a[..., start:end, :]) + 0


def cut_layer(layer, start: int, end: int):
    """The piece of a layer for positions [start, end)."""
    if isinstance(layer, CacheList):
        return tuple(cut_layer(c, start, end) for c in layer.caches)
    if not isinstance(layer, sc.TRIMMABLE):
        return None
    return KVPiece(
        tuple(_compact(a, start, end) for a in _as_tuple(layer.keys)),
        tuple(_compact(a, start, end) for a in _as_tuple(layer.values)),
    )


def piece_arrays(piece) -> list[mx.array]:
    if piece is None:
        return []
    if isinstance(piece, tuple):
        return [a for p in piece for a in piece_arrays(p)]
    return [*piece.keys, *piece.values]


def template_of(layer):
    """An empty copy of a layer: its class and settings (quantization, window), no arrays."""
    if isinstance(layer, CacheList):
        return CacheList(*(template_of(c) for c in layer.caches))
    out = copy.copy(layer)
    if isinstance(layer, sc.TRIMMABLE):
        out.keys = out.values = None
        out.offset = 0
    return out


def join_layer(template, pieces: list, snap_item, length: int):
    """A private layer at `length` positions: trimmable parts from the pieces (one per block,
    the last already cut), the others from a checkpoint's snapshot item."""
    if isinstance(template, CacheList):
        subs = snap_item if isinstance(snap_item, tuple) else (None,) * len(template.caches)
        return CacheList(
            *(join_layer(t, [p[i] for p in pieces], s, length) for i, (t, s) in enumerate(zip(template.caches, subs)))
        )
    if not isinstance(template, sc.TRIMMABLE):
        if snap_item is None:
            raise ValueError("no checkpoint for a layer that cannot be cut back")
        return copy.deepcopy(snap_item)
    out = copy.copy(template)
    keys = [mx.concatenate([p.keys[i] for p in pieces], axis=-2) for i in range(len(pieces[0].keys))]
    values = [mx.concatenate([p.values[i] for p in pieces], axis=-2) for i in range(len(pieces[0].values))]
    out.keys = tuple(keys) if len(keys) > 1 else keys[0]  # a quantized layer's keys are a triple
    out.values = tuple(values) if len(values) > 1 else values[0]
    out.offset = length
    return out


# -- blocks --------------------------------------------------------------------------------------
@dataclass(eq=False)
class Block:
    key: bytes
    parent: Block | None
    tokens: tuple[int, ...]
    start: int  # position of its first token in the sequence
    pieces: list  # per layer
    checkpoints: dict[int, list] = field(default_factory=dict)  # position in (start, end] -> snapshot
    boundaries: set[int] = field(default_factory=set)  # checkpoints at message boundaries
    children: dict[bytes, Block] = field(default_factory=dict)
    tick: int = 0  # recency order (a counter: ties would make eviction arbitrary)
    used_at: float = 0.0  # wall clock, for the disk tier
    hits: int = 0
    priority: float = 0.0  # eviction order (worker/model/cache/eviction.py): lowest first
    held_until: float = 0.0  # a client's caching hint (wall clock): leaves after every unheld block
    pins: int = 0
    nbytes: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) == BLOCK_TOKENS

    @property
    def checkpoint_bytes(self) -> int:
        return sum(sc.nbytes(s) for s in self.checkpoints.values())

    def measure(self) -> None:
        self.nbytes = sum(a.nbytes for p in self.pieces for a in piece_arrays(p)) + self.checkpoint_bytes

    def chain(self) -> list[Block]:
        out, b = [], self
        while b is not None:
            out.append(b)
            b = b.parent
        return out[::-1]


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockTree:
    """Every block in memory, by key, with the tree they form and their byte total."""

    def __init__(self):
        self.roots: dict[bytes, Block] = {}
        self.blocks: dict[bytes, Block] = {}
        self.nbytes = 0
        self._tick = 0
        self.clock = Clock()  # eviction's: recency, hits and cost to recompute, weighed
        self.templates: list | None = None  # the model's layers, empty (set by the first insert)
        self.on_gone: Callable[[bytes], None] | None = None  # told each key that leaves (prefix_events)

    def touch(self, block: Block, hit: bool = False) -> None:
        self._tick += 1
        now = time.time()
        for b in block.chain():  # a hit used the whole chain: each block's worth grows
            b.tick, b.used_at, b.hits = self._tick, now, b.hits + hit
            b.priority = self.clock.priority(b.end, b.hits)

    def children_of(self, parent: Block | None) -> dict[bytes, Block]:
        return self.roots if parent is None else parent.children

    def walk(self, tokens: list[int]) -> tuple[Block | None, list[tuple[Block, int]]]:
        """The deepest block whose chain is a run of whole blocks of `tokens`, and the
        children below it sharing some tokens with what follows: (child, tokens shared)."""
        node: Block | None = None
        pos = 0
        while pos + BLOCK_TOKENS <= len(tokens):
            child = self.children_of(node).get(chain_key(node.key if node else ROOT, tokens[pos : pos + BLOCK_TOKENS]))
            if child is None:
                break
            node, pos = child, pos + BLOCK_TOKENS
        rest = tokens[pos : pos + BLOCK_TOKENS]
        partial = [(c, common_prefix(c.tokens, rest)) for c in self.children_of(node).values()]
        return node, [(c, n) for c, n in partial if n > 0]

    def add(self, block: Block) -> None:
        self.children_of(block.parent)[block.key] = block
        self.blocks[block.key] = block
        block.measure()
        self.nbytes += block.nbytes

    def remove(self, block: Block) -> None:
        """Drop a leaf block."""
        assert not block.children, "only leaves leave"
        self.children_of(block.parent).pop(block.key, None)
        self.blocks.pop(block.key, None)
        self.nbytes -= block.nbytes
        if self.on_gone is not None:
            self.on_gone(block.key)

    def add_checkpoint(self, block: Block, position: int, snap: list, boundary: bool) -> None:
        if position in block.checkpoints or not block.start < position <= block.end:
            return
        block.checkpoints[position] = snap
        if boundary:
            block.boundaries.add(position)
        size = sc.nbytes(snap)
        block.nbytes += size
        self.nbytes += size

    def leaves(self) -> list[Block]:
        return [b for b in self.blocks.values() if not b.children]

    def evictable(self) -> list[Block]:
        return [b for b in self.blocks.values() if not b.children and not b.pins]

    def clear(self) -> None:
        keys = list(self.blocks) if self.on_gone is not None else []
        self.roots.clear()
        self.blocks.clear()
        self.nbytes = 0
        for key in keys:
            self.on_gone(key)


def assemble(templates: list, chain: list[Block], length: int, snap: list | None) -> list:
    """A row's private cache for the first `length` positions of a chain."""
    pieces = []
    for b in chain:
        if b.start >= length:
            break
        take = min(b.end, length) - b.start
        pieces.append([p if take == len(b.tokens) else _cut_piece(p, take) for p in b.pieces])
    items = snap if snap is not None else [None] * len(templates)
    return [join_layer(t, [p[i] for p in pieces], s, length) for i, (t, s) in enumerate(zip(templates, items))]


def _cut_piece(piece, length: int):
    if piece is None:
        return None
    if isinstance(piece, tuple):
        return tuple(_cut_piece(p, length) for p in piece)
    return piece.cut(length)
