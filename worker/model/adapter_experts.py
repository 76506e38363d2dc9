"""LoRA on the experts of an MoE block, per row (worker/model/adapters.py serves the plain layers).

mlx-lm's LoRASwitchLinear adds, for each token, `scale * B[e] @ A[e] @ x` for the experts e
the router picked, through gather_mm. Per row here: each adapter in the batch adds that
product to the tokens of its own rows only. An MoE block (SwitchGLU, SwitchMLP) sorts its
tokens by expert when it has many (64 expert picks or more) and hands its expert layers the
sorted tokens; so the block itself works out, before it runs, the adapter slot of each token
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
    on the tokens of its own rows (their slots set by the routed MoE block around it)."""

    def __init__(self, base: nn.Module, routing, table):
        super().__init__()
        self.base = base
        self.routing = routing
        self.table = table

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base(x, indices, sorted_indices=sorted_indices)
        slots = self.routing.token_slots
        if slots is None:
            return y
        for slot in self.routing.active:
            lora = self.table.by_slot.get(slot)
            if lora is None:
                continue
            a, b, scale = lora  # as mlx-lm's LoRASwitchLinear
            z = mx.gather_mm(x, a.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
            z = mx.gather_mm(z, b.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
            y = y + mx.where(slots == slot, (scale * z).astype(x.dtype), 0)
        return y


def _token_slots(rows: mx.array, indices: mx.array) -> mx.array:
    """Each expert pick's adapter slot, shaped as the expert layers' outputs broadcast it."""
    per_pick = mx.broadcast_to(rows.reshape((-1,) + (1,) * (indices.ndim - 1)), indices.shape)
    if indices.size >= SORT_FROM:  # the block's own order (switch_layers._gather_sort)
        order = mx.argsort(indices.flatten())
        return per_pick.flatten()[order].reshape(-1, 1, 1)
    return per_pick[..., None, None]


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
            rows = self._lora_routing.indices
            if rows is None:
                return cls.__call__(self, x, indices)
            self._lora_routing.token_slots = _token_slots(rows, indices)
            try:
                return cls.__call__(self, x, indices)
            finally:
                self._lora_routing.token_slots = None

        routed = _ROUTED[cls] = type(f"LoRARouted{cls.__name__}", (cls,), {"__call__": __call__})
    object.__setattr__(block, "_lora_routing", routing)
    block.__class__ = routed
