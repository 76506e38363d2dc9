"""Reuse a moved run of cached KV: fill-in-the-middle as the user types.

A keystroke changes a FIM prompt at the cursor. In prefix-suffix-middle order (Qwen-Coder,
StarCoder, ...) everything after the cursor (the rest of the file, then the middle token) is
the same tokens as in the last keystroke's prompt, one or two positions further on, so a
prefix lookup stops at the cursor and the whole suffix would be read again on every key.

Here, as llama.cpp's `--cache-reuse` does, the run of tokens the new prompt ends with that
the last stored FIM prompt also ends with keeps its KV: the edit's few tokens are read on top
of the prefix the lookup found, then the old run's KV is appended with its keys rotated to
the new positions. RoPE keys at position p rotated by d equal the keys at p + d, so the
rotation is exact; what is approximate (and accepted by llama.cpp and editors) is that the
moved run attended to the old text before the cursor, not the edited one. llama.cpp reuses
only runs that moved left (deleted text); an insertion is read here too.

Off by default (fim.kv_shift_min_tokens, as llama.cpp's --cache-reuse is): the moved run's
deeper layers remember where the cursor was when it was read. On Qwen2.5-Coder-0.5B, after
the last 10 characters of a function hole were typed key by key, every completion went on
from the first key's cursor (docs/api.md has the measurement).

Only for FIM prompts (they contain the model's FIM middle token) and only for models whose
every layer is plain attention KV (mlx-lm's KVCache) with one plain RoPE: quantized, windowed,
recurrent or magnitude-scaled (YaRN) layers are left to the ordinary prefix lookup."""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from . import kv_blocks as kb
from . import scopes

log = logging.getLogger(__name__)

# RoPE classes whose call is a pure rotation by position (no magnitude scale): rotating a
# rotated key again by d moves it by d positions.
PURE_ROTATIONS = (nn.RoPE, Llama3RoPE)
MAX_EDIT_TOKENS = 256  # an edit longer than this (a paste) is read by the ordinary prefill
MAX_VISITS = 4096  # blocks looked at for the last stored prompt below the cursor


@dataclass
class ShiftStats:
    splices: int = 0  # lookups that reused a moved run
    moved_tokens: int = 0  # tokens whose KV was moved instead of read
    edit_tokens: int = 0  # tokens read at admission between the prefix and the moved run


def find_rope(model) -> nn.Module | None:
    """The model's one RoPE, if every one it has is the same pure rotation; else None."""
    found: list[nn.Module] = []
    for _, module in model.named_modules():
        name = type(module).__name__.lower()
        if isinstance(module, PURE_ROTATIONS) and type(module) in PURE_ROTATIONS:
            found.append(module)
        elif "rope" in name or "rotary" in name:
            return None  # another kind of position encoding: not known to compose
    if not found or any(_settings(m) != _settings(found[0]) for m in found[1:]):
        return None
    return found[0]


def _settings(rope: nn.Module) -> tuple:
    plain = {k: v for k, v in vars(rope).items() if isinstance(v, (int, float, bool, str))}
    freqs = getattr(rope, "_freqs", None)
    return type(rope), tuple(sorted(plain.items())), None if freqs is None else tuple(freqs.tolist())


class ShiftReuse:
    def __init__(self, rope: nn.Module, fim_middle: int, min_tokens: int):
        """fim_middle: the token that marks a FIM prompt; min_tokens: the shortest moved run
        worth reusing (llama.cpp's --cache-reuse)."""
        self.rope, self.fim_middle, self.min_tokens = rope, fim_middle, min_tokens
        self.stats = ShiftStats()

    @classmethod
    def for_model(cls, model, fresh_cache: list, fim_middle: int | None, min_tokens: int) -> ShiftReuse | None:
        if fim_middle is None or min_tokens <= 0:
            return None
        if not fresh_cache or any(type(layer) is not KVCache for layer in fresh_cache):
            return None
        rope = find_rope(model)
        return None if rope is None else cls(rope, fim_middle, min_tokens)

    def extend(
        self, model, tree: kb.BlockTree, prompt: list[int], cache: list, covered: int, scope: int = scopes.BASE
    ) -> tuple[list, int]:
        """(cache, covered) grown by the edit and the moved run, or as given when nothing
        is worth moving; only the row's own cache scope is searched (worker/model/cache/scopes.py).
        Never raises: a failed splice falls back to the prefix it had."""
        try:
            keys, marker = scopes.scoped(prompt, scope), scopes.scoped([self.fim_middle], scope)[0]
            found = self._plan(tree, keys, covered, marker)
            if found is None:
                return cache, covered
            chain, start, length, run_start = found
            edit = prompt[covered:run_start]  # the model reads the tokens themselves
            moved = _gather(chain, start, start + length)
            if edit:  # the keystroke's tokens, on top of the prefix (they attend to it)
                model(mx.array(edit)[None], cache=cache)
            shift = covered + len(edit) - start
            for layer, (keys, values) in zip(cache, moved):
                layer.update_and_fetch(self._rotate(keys, shift), values)
            mx.eval([layer.state for layer in cache])
        except Exception:  # the ordinary prefill is always right; the splice only saves time
            log.exception("kv shift: splice failed; reading the rest of the prompt")
            for layer in cache:  # back to the prefix alone (the edit may have been read)
                if layer.offset > covered:
                    layer.trim(layer.offset - covered)
            return cache, covered
        self.stats.splices += 1
        self.stats.moved_tokens += length
        self.stats.edit_tokens += len(edit)
        return cache, covered + len(edit) + length

    def _plan(self, tree: kb.BlockTree, prompt: list[int], covered: int, marker: int):
        """The stored chain, where its run starts there, the run's length, and where it starts in
        the prompt (the edit is what lies between the cached prefix and that). prompt and marker
        (the FIM middle token) are the row's cache keys."""
        if not covered or len(prompt) - covered - 1 < self.min_tokens or marker not in prompt:
            return None
        chain = _latest_below(tree, prompt, marker)
        if not chain:
            return None
        old = [t for b in chain for t in b.tokens]
        # The stored sequence is the last prompt and its answer: line the two prompts up at
        # their last middle token, then grow the run back over the suffix and on over any
        # text after the middle token (/infill's `prompt`).
        here, there = _last(prompt, marker), _last(old, marker)
        if here < covered or there < 0:
            return None
        back = 0
        while back < min(here - covered, there) and old[there - 1 - back] == prompt[here - 1 - back]:
            back += 1
        ahead = 0
        while (
            here + 1 + ahead < len(prompt)
            and there + 1 + ahead < len(old)
            and old[there + 1 + ahead] == prompt[here + 1 + ahead]
        ):
            ahead += 1
        start = here - back  # where the run begins in the new prompt
        length = min(here + 1 + ahead, len(prompt) - 1) - start  # the last token is always run
        if length < self.min_tokens or start - covered > MAX_EDIT_TOKENS:
            return None
        return chain, there - back, length, start

    def _rotate(self, keys: mx.array, shift: int) -> mx.array:
        # Every position moves by the same amount: one rotation each, as a length-1 sequence.
        b, h, n, d = keys.shape
        return self.rope(keys.reshape(b, h * n, 1, d), offset=shift).reshape(b, h, n, d)


def _last(tokens: list[int], token: int) -> int:
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == token:
            return i
    return -1


def _latest_below(tree: kb.BlockTree, prompt: list[int], marker: int) -> list[kb.Block] | None:
    """The most recently used stored FIM prompt sharing the prompt's whole blocks (the last
    keystroke's, in an editor): the chain of its leaf. A use touches a whole chain, so the
    newest leaf is found by following the newest child down (best first, by tick); a
    keystroke superseded while its prompt was still being read left a sequence without the
    middle token, and the search goes on to the next newest."""
    node, _ = tree.walk(prompt)
    heap = [(-b.tick, id(b), b) for b in tree.children_of(node).values()]
    heapq.heapify(heap)
    for _ in range(MAX_VISITS):
        if not heap:
            return None
        _, _, block = heapq.heappop(heap)
        if block.children:
            for child in block.children.values():
                heapq.heappush(heap, (-child.tick, id(child), child))
            continue
        chain = block.chain()
        if any(marker in b.tokens for b in reversed(chain)):
            return chain
    return None


def _gather(chain: list[kb.Block], start: int, end: int) -> list[tuple[mx.array, mx.array]]:
    """Each layer's keys and values for positions [start, end) of a chain in memory."""
    blocks = [b for b in chain if b.end > start and b.start < end]
    out = []
    for i in range(len(blocks[0].pieces)):
        keys = mx.concatenate([b.pieces[i].keys[0] for b in blocks], axis=-2)
        values = mx.concatenate([b.pieces[i].values[0] for b in blocks], axis=-2)
        lo, hi = start - blocks[0].start, end - blocks[0].start
        out.append((keys[..., lo:hi, :], values[..., lo:hi, :]))
    return out
