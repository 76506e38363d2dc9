"""How much prompt processing one engine step does: a per-step token budget.

Every step runs one decode step for the rows already generating and one prefill chunk for
the rows still reading their prompts (mlx-lm's BatchGenerator). The prefilling rows are one
right-padded batch, so a step costs (rows prefilling) x (the longest chunk) token-passes,
padding included. Bounding that product by `budget` bounds how long decoding rows wait per
step, whatever arrives; the same budget decides how many new prompts start:

- each prefilling row gets a chunk of budget // rows tokens (at least 1);
- a waiting prompt is admitted, first come first served, while every prefilling row (itself
  included) would still finish its prompt in this step or get at least a quarter of the
  budget: short prompts arriving together start together (a 512 budget takes six 80-token
  prompts in one step), a long prompt reading its thousands of tokens still lets up to three
  short ones in beside it at the next step (it slows down, they do not wait for it), and no
  row is ever sliced so thin that nobody finishes;
- when nothing is prefilling, the first waiting prompt is always admitted (progress).
"""

from __future__ import annotations

MIN_SHARE_DIVISOR = 4  # a long prompt keeps at least budget / 4 tokens per step


def chunk_for(rows: int, budget: int) -> int:
    return max(1, budget // max(1, rows))


def fits(remaining: list[int], budget: int) -> bool:
    """Whether these prefilling rows (tokens left to read) can share one step's budget."""
    if len(remaining) <= 1:
        return True
    share = chunk_for(len(remaining), budget)
    floor = max(1, budget // MIN_SHARE_DIVISOR)
    return all(share >= min(r, floor) for r in remaining)


def admit_count(prefilling: list[int], waiting: list[int], budget: int) -> int:
    """How many of `waiting` (tokens to read, in admission order) start this step, given the
    rows already prefilling (tokens each has left)."""
    plan = [r for r in prefilling if r > 0]
    admitted = 0
    for need in waiting:
        if need <= 0:  # served whole from the prefix cache: nothing to read
            admitted += 1
            continue
        if plan and not fits(plan + [need], budget):
            break
        plan.append(need)
        admitted += 1
    return admitted
