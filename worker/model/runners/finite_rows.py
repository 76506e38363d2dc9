"""Rows whose logits stopped being finite end with their own error.

A row's hidden state can overflow (an adapter whose weights are finite but whose product is
not, a float16 model past its range) and from then on its logits are NaN: greedy decoding
would go on emitting token 0, or whatever argmax makes of NaN, as if it were an answer. The
rows of a batch never mix their arithmetic (worker/model/adapters/stacks.py), so such a row is
its own fault: after each step the logits its tokens were drawn from are checked (NaN or
+inf; -inf is a mask's), and the row's guard records an explicit error, which ends that row
alone (worker/schedule/scheduler.py `_end_faulted`) before its token is sent."""

from __future__ import annotations

import mlx.core as mx

from ....shared.errors import invalid


def non_finite_uids(responses) -> set[int]:
    """The uids of the step's responses whose logits (the row's logprobs vector) hold NaN or +inf."""
    checked = [r for r in responses if getattr(r, "logprobs", None) is not None]
    if not checked:
        return set()
    flags = mx.stack([mx.logical_or(mx.isnan(r.logprobs), mx.isposinf(r.logprobs)).any() for r in checked])
    return {r.uid for r, bad in zip(checked, flags.tolist()) if bad}


def fault_non_finite(responses, rows: dict, adapter_of) -> None:
    """Record the error on each such row's guard (rows: uid -> Row; rows without a guard,
    in-process callers', are left)."""
    for uid in non_finite_uids(responses):
        guard = rows[uid].guard if uid in rows else None
        if guard is None or guard.faulted:
            continue
        adapter = adapter_of(uid)
        under = f" under the adapter '{adapter}'" if adapter else ""
        guard.record(
            invalid(
                f"the model's output stopped being finite (NaN or infinite logits){under}; this answer "
                "was ended here (the other requests of the batch are not affected)",
                "model",
            ),
            "decoding",
        )
