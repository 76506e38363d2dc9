"""LoRA on the experts of an MoE block, per row (worker/model/adapters/bank.py serves the plain layers).

mlx-lm's LoRASwitchLinear adds, for each token, `scale * B[e] @ A[e] @ x` for the experts e
the router picked, through gather_mm. Per row here: the resident adapters' expert weights
are stacked by position as for plain layers (worker/model/adapters/stacks.py), (positions x
experts) matrices, and each expert pick indexes `position * experts + e`, so one gather_mm
pair serves every adapter in the batch. An MoE block (SwitchGLU, SwitchMLP) sorts its
tokens by expert when it has many (64 expert picks or more) and hands its expert layers the
sorted tokens; so the block itself works out, before it runs, each pick's position and scale
in the order its expert layers will see them (the same argsort it makes itself). The block
keeps its class's code: its instance becomes a subclass whose __call__ does that first, so
the module tree, and the adapter weights' names in it, stay mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

SORT_FROM = 64  # SwitchGLU/SwitchMLP sort tokens by expert from this many picks (indices.size)
_ROUTED: dict[type, type] = {}


def expert_dims(layer: nn.Module) -> tuple[int, int, int] | None:
    """(experts, input, output) of an MoE expert layer; None for other kinds."""
    if isinstance(layer, (SwitchLinear, QuantizedSwitchLinear)):
        return layer.num_experts, layer.input_dims, layer.output_dims
    return None


def fits(a: mx.array, b: mx.array, dims: tuple[int, int, int]) -> bool:
    """Whether lora_a (experts, rank, input) and lora_b (experts, output, rank) fit the layer."""
    experts, inp, out = dims
    return (
        a.ndim == 3
        and b.ndim == 3
        and a.shape[0] == b.shape[0] == experts
        and a.shape[1] == b.shape[2]
        and (a.shape[2] == inp and b.shape[1] == out)
    )


class MultiLoRASwitchLinear(nn.Module):
    """An expert layer (plain or quantized) plus the resident adapters' expert deltas, each
    pick getting its own row's adapter (positions and scales set by the routed block)."""

    def __init__(self, base: nn.Module, routing, table):
        super().__init__()
        self.base = base
        self.routing = routing
        self.table = table

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base(x, indices, sorted_indices=sorted_indices)
        experts = self.base.num_experts
        for key, picks in self.routing.pick_positions.items():
            stack = self.table.stacks.get(key)
            if stack is None:
                continue
            a, b = (m.reshape(-1, *m.shape[2:]).swapaxes(-1, -2) for m in stack)  # (positions * experts, ...)
            chosen = picks * experts + indices
            # Not sorted by the combined index (the block sorted by expert only).
            z = mx.gather_mm(x, a, rhs_indices=chosen)
            z = mx.gather_mm(z, b, rhs_indices=chosen)
            scale = self.routing.pick_scales[key]
            delta = ((scale if z.dtype == scale.dtype else scale.astype(z.dtype)) * z).astype(x.dtype)
            inside = self.routing.pick_inside[key]
            # A pick whose row is outside the group is computed against position 0 (the block's
            # picks are in its own sorted order) and dropped by a select, never by arithmetic:
            # 0 x NaN would be NaN.
            y = y + delta if inside is None else mx.where(inside, y + delta, y)
        return y


def _per_pick(values: mx.array, indices: mx.array, order: mx.array | None) -> mx.array:
    """A per-row value for each expert pick, shaped as the block's expert layers get their
    indices: flat in the block's sorted order, else as the router's picks."""
    per_pick = mx.broadcast_to(values.reshape((-1,) + (1,) * (indices.ndim - 1)), indices.shape)
    return per_pick if order is None else per_pick.flatten()[order]


def route_block(block: nn.Module, routing) -> None:
    """Make an MoE block set its tokens' adapter slots while it runs (once per block)."""
    cls = type(block)
    if cls in _ROUTED.values():
        return
    if not isinstance(block, (SwitchGLU, SwitchMLP)):
        raise TypeError(f"LoRA on the experts of a {cls.__name__} block is not served")
    routed = _ROUTED.get(cls)
    if routed is None:

        def __call__(self, x, indices):
            routing = self._lora_routing
            if routing.indices is None:
                return cls.__call__(self, x, indices)
            # The block's own order (switch_layers._gather_sort), the same argsort of the same picks.
            order = mx.argsort(indices.flatten()) if indices.size >= SORT_FROM else None
            for key, positions in routing.row_positions.items():
                routing.pick_positions[key] = _per_pick(positions, indices, order)
                routing.pick_scales[key] = _per_pick(routing.row_scales[key], indices, order)[..., None, None]
                inside = routing.row_inside[key]
                picks_inside = None if inside is None else _per_pick(inside, indices, order)[..., None, None]
                routing.pick_inside[key] = picks_inside
            try:
                return cls.__call__(self, x, indices)
            finally:
                routing.pick_positions, routing.pick_scales, routing.pick_inside = {}, {}, {}

        routed = _ROUTED[cls] = type(f"LoRARouted{cls.__name__}", (cls,), {"__call__": __call__})
    object.__setattr__(block, "_lora_routing", routing)
    block.__class__ = routed
