"""What a row counts against the KV budget: optimistic admission, and who is paused when
the rows outgrow it (vLLM's policy, on mlx-lm's batch).

An agent sends max_tokens 32000 and uses a few hundred: reserving every row's reach
(prompt + max_tokens) ran one such row at a time. Instead a row that can be paused and
resumed exactly (Sequence.resumable) reserves what it holds (its prompt, read in full, and
the tokens it generated) plus DECODE_ALLOWANCE tokens of growth; a row that cannot be paused
(a grammar, logprobs, sibling choices, images) still reserves its whole reach, so the rows
that cannot make room always fit together.

Before each step the rows' KV after it (each row one token longer) is checked against the
budget; while it does not fit, the least urgent priority class's latest arrival among the
pausable rows is paused (never the only row): its KV goes to the prefix store (RAM, then the
disk tier by the store's own eviction) and it re-queues at its old place, to resume from the
store when the others leave it room. The oldest row is never the one paused while a later
one runs, so every row finishes; a row that fits alone (KVBudget.check_alone) always does."""

from __future__ import annotations

from collections.abc import Iterable

from ..model.memory.kv_budget import DECODE_ALLOWANCE
from .sequence import Sequence


def reach(seq: Sequence) -> int:
    """The tokens a row may hold: its prompt and every token it may generate."""
    return len(seq.prompt) + seq.max_tokens


def held(seq: Sequence) -> int:
    """The tokens a row holds once its prompt is read: prompt and tokens generated so far."""
    return len(seq.prompt) + len(seq.tokens)


def after_step(seq: Sequence) -> int:
    """The tokens a row holds after the next step (one more token, at most its reach)."""
    return min(reach(seq), held(seq) + 1)


def reserve(seq: Sequence, pausable: bool, allowance: int = DECODE_ALLOWANCE) -> int:
    """The tokens admission counts for a row: what it holds plus the decode allowance when
    it can be paused to make room later, else all it may reach."""
    return min(reach(seq), held(seq) + allowance) if pausable else reach(seq)


def victim(rows: Iterable[tuple[Sequence, bool]]) -> Sequence | None:
    """The row to pause for memory among (row, pausable): the latest arrival of the least
    urgent priority class (a larger number is less urgent), or None."""
    candidates = [seq for seq, pausable in rows if pausable]
    return max(candidates, key=lambda s: (s.req.priority, s.arrival), default=None)
