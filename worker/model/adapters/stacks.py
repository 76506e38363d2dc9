"""The per-row low-rank product of a plain linear layer, one `gather_mm` per step.

The resident adapters' (lora_a, lora_b) of a layer are stacked, one position per adapter, in
a group per (rank, dtypes): A (positions, in, rank), B (positions, rank, out). Each row indexes
its adapter's position, so a layer adds every row's `scale * (x @ A) @ B` with two gather_mm
calls for the whole batch, as Punica/S-LoRA's BGMV does, whatever the number of adapters in
it. Rows without an adapter of a group never enter its product: when some rows of the batch
are outside it, only the rows inside are gathered, multiplied and added back (as Punica's
kernels skip a row whose adapter index is -1), and the others keep the base output untouched.
Multiplying them by a scale of 0 instead (the first version) let one adapter's NaN or
overflowing weights reach every row: 0 x NaN is NaN.

Why this and not a masked matmul per adapter (the first version) or rows sorted into one
matmul per adapter: measured in one process on SmolLM2-135M shapes (hidden 576, rank 8 and
16, 8 and 16 rows, 4 adapters and rows without one), it is as cheap or cheaper at
decode (four ops per layer instead of five or six per adapter present) and about half the
masked matmuls' cost on a prefill chunk, and it is the only one whose per-row arithmetic is
that of mlx-lm's LoRALinear running the row alone: gather_mm multiplies each row by its own
matrices (M = that row's tokens), where one matmul over the whole batch rounds a long
prefill chunk differently. Folding the scale into B saves one op but rounds differently
unless the scale is a power of two; one matmul against the adapters' concatenated A's costs
the same and is not exact either. A row's delta is `(scale * z).astype(x.dtype)` with the scale in z's dtype, as
mlx-lm writes it, so greedy output equals `mlx_lm.load(base, adapter_path=...)` alone.

An MoE block's expert layers stack the same way, each position holding an adapter's
(experts, ...) matrices (worker/model/adapters/experts.py). Positions are the same in every
layer of a group (an adapter's position is per group, not per
layer); a layer the adapter does not target holds zeros at it. A free position is reused;
trailing free ones are dropped, so the stacks hold the resident adapters' bytes (plus zeros
only where adapters of one group target different layers)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GroupKey = tuple[int, str, str]  # (rank, lora_a's dtype, lora_b's dtype)


def group_key(a: mx.array, b: mx.array) -> GroupKey:
    return a.shape[1], str(a.dtype), str(b.dtype)


class RowRouting:
    """The rows of the forward being built: each row's adapter slot (None: no row has one),
    and for the stacked layers each group's rows, positions and scales."""

    def __init__(self) -> None:
        self.indices: mx.array | None = None
        self.active: tuple[int, ...] = ()
        # Inside an MoE block: each expert pick's position, scale and whether its row is in the
        # group (None: every row is), per group (adapter_experts.py).
        self.pick_positions: dict[GroupKey, mx.array] = {}
        self.pick_scales: dict[GroupKey, mx.array] = {}
        self.pick_inside: dict[GroupKey, mx.array | None] = {}
        self.positions: dict[GroupKey, mx.array] = {}  # (rows inside,) int32
        self.picked: dict[GroupKey, mx.array | None] = {}  # the rows inside, by batch index; None: all
        self._scales: dict[GroupKey, mx.array] = {}  # (rows inside, 1, 1) float32
        # Per row of the whole batch, for MoE blocks, whose picks are masked instead (outside: 0, False).
        self.row_positions: dict[GroupKey, mx.array] = {}
        self.row_scales: dict[GroupKey, mx.array] = {}
        self.row_inside: dict[GroupKey, mx.array | None] = {}
        self._cast: dict[tuple[GroupKey, mx.Dtype], mx.array] = {}

    def set(self, slots: list[int], active: tuple[int, ...], groups: dict[GroupKey, list[tuple[int, float] | None]]):
        """groups: per group, each row's (position, scale), or None for a row outside it."""
        self.indices, self.active = mx.array(slots, dtype=mx.int32), active
        for key, rows in groups.items():
            inside = [i for i, row in enumerate(rows) if row is not None]
            every = len(inside) == len(rows)
            self.picked[key] = None if every else mx.array(inside, dtype=mx.int32)
            self.positions[key] = mx.array([rows[i][0] for i in inside], dtype=mx.int32)
            self._scales[key] = mx.array([rows[i][1] for i in inside], dtype=mx.float32).reshape(-1, 1, 1)
            full = [row or (0, 0.0) for row in rows]
            self.row_positions[key] = self.positions[key] if every else mx.array([p for p, _ in full], dtype=mx.int32)
            self.row_scales[key] = mx.array([s for _, s in full], dtype=mx.float32)
            self.row_inside[key] = None if every else mx.array([row is not None for row in rows])

    def clear(self) -> None:
        self.indices, self.active = None, ()
        self.positions, self.picked, self._scales, self._cast = {}, {}, {}, {}
        self.row_positions, self.row_scales, self.row_inside = {}, {}, {}

    def scale(self, key: GroupKey, dtype: mx.Dtype) -> mx.array:
        """The group's scales of the rows inside it, in the product's dtype (mlx-lm multiplies
        by a Python float, which takes the array's dtype); cast once per forward, not per layer."""
        if dtype == mx.float32:
            return self._scales[key]
        cast = self._cast.get((key, dtype))
        if cast is None:
            cast = self._cast[(key, dtype)] = self._scales[key].astype(dtype)
        return cast


class LoraTable:
    """One layer's adapter weights. A plain object, so that nn.Module keeps it out of the
    model's parameter tree (adapters come and go; the model's weights do not).

    stacks: group -> (A, B) stacked by position (an MoE expert layer's with an experts axis
    after the positions); held: the positions holding an adapter."""

    def __init__(self) -> None:
        self.stacks: dict[GroupKey, tuple[mx.array, mx.array]] = {}
        self.held: dict[GroupKey, set[int]] = {}

    def restack(self, key: GroupKey, length: int, put: dict[int, tuple[mx.array, mx.array] | None]) -> list[mx.array]:
        """The group's stacks rebuilt to `length` positions, with `put`'s positions set (None:
        zeros). Returns the new arrays, to evaluate (which copies them and frees the old)."""
        held = self.held.setdefault(key, set())
        for pos, pair in put.items():
            (held.add if pair is not None else held.discard)(pos)
        held.intersection_update(range(length))
        old = self.stacks.get(key)
        if not held:
            self.stacks.pop(key, None)
            self.held.pop(key, None)
            return []
        # Shapes and dtypes of one position's (A, B): from the old stacks, else a new pair.
        template = [m[0] for m in old] if old is not None else next(p for p in put.values() if p is not None)
        new = []
        for i in range(2):
            zeros = mx.zeros(template[i].shape, dtype=template[i].dtype)
            entries = []
            for pos in range(length):
                if pos in put:
                    pair = put[pos]
                    entries.append(pair[i] if pair is not None else zeros)
                elif old is not None and pos in held and pos < old[i].shape[0]:
                    entries.append(old[i][pos])
                else:
                    entries.append(zeros)
            new.append(mx.stack(entries))
        self.stacks[key] = (new[0], new[1])
        return new


class MultiLoRALinear(nn.Module):
    """A linear layer (plain or quantized) plus the low-rank deltas of the resident adapters
    that target it, each row getting its own adapter's (module docstring)."""

    def __init__(self, base: nn.Module, routing: RowRouting, table: LoraTable):
        super().__init__()
        self.base = base
        self.routing = routing
        self.table = table

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        routing = self.routing
        if routing.indices is None:
            return y
        if x.shape[0] != routing.indices.shape[0]:
            raise ValueError(f"LoRA routing: {routing.indices.shape[0]} rows set for a batch of {x.shape[0]}")
        rows = x if x.ndim == 3 else x.reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, in)
        out = y if y.ndim == 3 else y.reshape(rows.shape[0], -1, y.shape[-1])  # (rows, tokens, out)
        for key, positions in routing.positions.items():
            stack = self.table.stacks.get(key)
            if stack is None:  # no adapter of this group targets this layer
                continue
            a, b = stack
            picked = routing.picked[key]
            inside = rows if picked is None else rows[picked]  # only the group's own rows
            z = mx.gather_mm(mx.gather_mm(inside, a, rhs_indices=positions), b, rhs_indices=positions)
            delta = (routing.scale(key, z.dtype) * z).astype(x.dtype)  # as mlx-lm's LoRALinear
            out = out + delta if picked is None else out.at[picked].add(delta)
        return out if y.ndim == 3 else out.reshape(y.shape)
