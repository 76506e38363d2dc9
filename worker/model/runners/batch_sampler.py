"""The decode step's per-row work done once for the whole batch.

mlx-lm's generation batch calls each row's sampler on its own row when the rows' samplers
are distinct objects (one call, one sort, one draw per row, then a concatenate), and runs
every row through the logits-processor loop as soon as one row has a processor. Here the
step does, for the whole batch:

- penalties and logit bias: one scatter/mask per kind over the rows that have them
  (RowPenalties), in mlx-lm's order and with the same float operations, so the values are
  bit-identical to the per-row processors; rows with other processors (grammar masks) run
  those per row, and rows without processors are not touched at all;
- sampling: per-row temperature / top-p / min-p / top-k as arrays; one categorical draw for
  the unseeded rows (in cache-sized groups of rows on a CPU); the argmax for greedy rows.
  Rows with a seed draw from their own key, one small call each (MLX's categorical is an
  inverse-CDF draw that vmap cannot batch over keys), which gives exactly the per-row
  seeded sampler's tokens whatever else is in the batch. Masks come from mlx-lm's own
  compiled filters (top-p with a per-row threshold column, top-k once per distinct k), so
  they are the per-row masks exactly.

How it plugs in: VectorGenerationBatch subclasses mlx-lm's GenerationBatch and replaces
only `_step`. Each row's parameters travel in its sampler object (a RowSampling) and its
processor tuple, which mlx-lm already keeps aligned with the batch's rows through inserts,
filters and extends, so there is no second copy of the row order to keep in sync. The first
step of rows that just finished prefill runs in mlx-lm's own (per-row) step, because mlx-lm
builds that small batch itself; RowSampling and RowPenalties do the same thing per row, so
that costs one row-sized call per request, not per token.

mlx-lm's step already overlaps: it queues step t+1 with mx.async_eval before handing step t's
tokens to the host (detokenizing, events), and this step keeps that order. mx.compile of the
sampling arithmetic measured no gain on CPU (the cost is full-vocabulary passes, not
dispatch), so nothing here is compiled beyond mlx-lm's own (compiled) filters."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from ....shared.platform import on_cpu_device
from .isolation import heal_random_state
from .sampling import PENALTY_CONTEXT, REPETITION_CONTEXT, RowPenalties, RowSampling


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _column(values: list[float]) -> mx.array:
    return mx.array(values, dtype=mx.float32)[:, None]


def _on_rows(x: mx.array, rows: mx.array | None, fn) -> mx.array:
    """fn applied to some rows of x (all when rows is None). x itself is left as it was:
    item assignment rewrites the Python array object in place, and the caller's logprobs
    must stay the unfiltered distribution."""
    if rows is None:
        return fn(x)
    out = x[:]
    out[rows] = fn(x[rows])
    return out


def _subset(positions: list[int], n: int) -> mx.array | None:
    return None if positions == list(range(n)) else mx.array(positions)


# -- sampling ---------------------------------------------------------------------------
@dataclass
class SamplePlan:
    """How one batch composition samples; rebuilt only when the rows change."""

    rows: tuple  # the rows' RowSampling objects, in batch order
    drawn: list[int]  # batch rows that sample: unseeded first, then seeded
    drawn_index: mx.array | None  # None when drawn is every row in order
    greedy: mx.array | None  # batch rows that take the argmax
    restore: mx.array | None  # puts [drawn..., greedy...] back in batch order
    inverse_temperature: mx.array  # [drawn, 1]
    top_p: tuple[mx.array | None, mx.array] | None  # (positions in drawn, [rows, 1] values)
    min_p: tuple[mx.array | None, mx.array] | None  # (positions in drawn, [rows, 1] log(min_p))
    top_k: list[tuple[int, mx.array | None]]
    unseeded: int
    seeded: list[RowSampling]
    # Batch rows normalised into log-probabilities (rows that report them, seeded rows);
    # None when there are none, `everything` when all are.
    normalised: mx.array | None | object

    @classmethod
    def build(cls, rows: tuple) -> SamplePlan:
        unseeded = [i for i, r in enumerate(rows) if not r.greedy and not r.seeded]
        seeded = [i for i, r in enumerate(rows) if r.seeded]
        greedy = [i for i, r in enumerate(rows) if r.greedy]
        drawn = unseeded + seeded
        exact = [i for i, r in enumerate(rows) if r.exact]
        params = [rows[i].params for i in drawn]
        n = len(drawn)
        top_p = [j for j, p in enumerate(params) if 0 < p.top_p < 1.0]
        min_p = [j for j, p in enumerate(params) if p.min_p]
        ks = sorted({p.top_k for p in params if p.top_k > 0})
        order = drawn + greedy
        return cls(
            rows=rows,
            drawn=drawn,
            drawn_index=_subset(drawn, len(rows)),
            greedy=mx.array(greedy) if greedy else None,
            restore=None if order == list(range(len(rows))) else mx.argsort(mx.array(order)),
            # 1/T and log(min_p) in double, rounded once: the scalars the per-row sampler uses.
            inverse_temperature=_column([1 / p.temperature for p in params]),
            top_p=(_subset(top_p, n), _column([params[j].top_p for j in top_p])) if top_p else None,
            min_p=(_subset(min_p, n), _column([math.log(params[j].min_p) for j in min_p])) if min_p else None,
            top_k=[(k, _subset([j for j, p in enumerate(params) if p.top_k == k], n)) for k in ks],
            unseeded=len(unseeded),
            seeded=[rows[i] for i in seeded],
            normalised=_normalised(exact, len(rows)),
        )


EVERY_ROW = object()


def _normalised(exact: list[int], n: int):
    if not exact:
        return None
    index = _subset(exact, n)
    return EVERY_ROW if index is None else index


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def scores(logits: mx.array, plan: SamplePlan) -> mx.array:
    """What the step samples from and hands back per row: the log-probabilities for the rows
    that need their exact values, the logits themselves for the rest. Both give the same
    distribution at any temperature and the same argmax (log-softmax shifts a row by a
    constant), and on a CPU the normalisation is a full-vocabulary exp that cost 12.4 ms of a
    216-ms step at batch 16 (bench/HISTORY.md at 3b9d616, "step against its floor"), for values nobody reads."""
    if plan.normalised is None:
        return logits
    if plan.normalised is EVERY_ROW:
        return log_softmax(logits)
    return _on_rows(logits, plan.normalised, log_softmax)


def _min_p(x: mx.array, log_min_p: mx.array) -> mx.array:
    # mlx-lm's apply_min_p (min_tokens_to_keep=1) with a per-row threshold.
    scaled = mx.max(x, axis=-1, keepdims=True) + log_min_p.astype(x.dtype)
    return mx.where(x < scaled, -float("inf"), x)


def filter_rows(x: mx.array, plan: SamplePlan) -> mx.array:
    """top-p, then min-p, then top-k (mlx-lm's order), each on the rows that ask for it."""
    if plan.top_p is not None:
        rows, values = plan.top_p
        x = _on_rows(x, rows, lambda r: apply_top_p(r, values))
    if plan.min_p is not None:
        rows, values = plan.min_p
        x = _on_rows(x, rows, lambda r: _min_p(r, values))
    for k, rows in plan.top_k:
        x = _on_rows(x, rows, lambda r, k=k: apply_top_k(r, k))
    return x


# MLX's categorical makes several full-vocabulary passes (softmax, cumsum, search). On a CPU
# these run from cache when a call holds a few rows (a float32 row of a 49k vocabulary is
# 196 KB; this machine's L2 is 1 MB per core), and from memory when it holds the whole batch:
# measured here, batch 32 in calls of 2-4 rows took 22-65 ms against 85-176 ms in one call
# (and 43-85 ms row by row). A GPU takes the whole batch in one call.
CPU_CALL_BYTES = 512 * 1024


def _rows_per_call(x: mx.array) -> int:
    if not on_cpu_device():
        return x.shape[0]
    return max(1, CPU_CALL_BYTES // (x.shape[-1] * x.dtype.size))


def _categorical(x: mx.array) -> mx.array:
    """mx.random.categorical over the rows of x, a cache-sized group of rows per call."""
    n = _rows_per_call(x)
    if n >= x.shape[0]:
        return mx.random.categorical(x)
    return mx.concatenate([mx.random.categorical(x[i : i + n]) for i in range(0, x.shape[0], n)])


def sample_rows(logprobs: mx.array, plan: SamplePlan) -> mx.array:
    """One token per row, as each row's RowSampling would draw it."""
    if not plan.drawn:
        return mx.argmax(logprobs, axis=-1)
    x = logprobs if plan.drawn_index is None else logprobs[plan.drawn_index]
    # x * (1/T) row by row: the float32 product the per-row sampler computes.
    x = filter_rows(x, plan) * plan.inverse_temperature.astype(x.dtype)
    drawn = []
    if plan.unseeded:  # drawn together, from the global generator as mlx-lm's
        drawn.append(_categorical(x[: plan.unseeded] if plan.seeded else x))
    # MLX's categorical is an inverse-CDF draw (searchsorted), which vmap cannot batch over
    # keys: each seeded row draws on its own, from its own key, exactly as RowSampling does.
    for j, row in enumerate(plan.seeded, start=plan.unseeded):
        drawn.append(mx.random.categorical(x[j : j + 1], key=row.next_key()))
    if plan.greedy is not None:
        drawn.append(mx.argmax(logprobs[plan.greedy], axis=-1))
    tokens = drawn[0] if len(drawn) == 1 else mx.concatenate(drawn)
    return tokens if plan.restore is None else tokens[plan.restore]


# -- penalties and bias ------------------------------------------------------------------
@dataclass
class PenaltyPlan:
    """The rows with RowPenalties and their parameters as arrays; rebuilt when they change."""

    rows: tuple  # the RowPenalties objects, in batch order of their rows
    batch_rows: list[int]  # where they sit in the batch
    index: mx.array | None  # their batch rows; None when every row, in order
    bias: tuple[mx.array, mx.array, mx.array] | None  # (plan row, token id, value)
    repetition: mx.array | None  # [rows, 1]; 1.0 where a row has none
    presence: mx.array | None  # [rows, 1]; 0.0 where a row has none
    frequency: mx.array | None  # [rows, 1]; 0.0 where a row has none

    @classmethod
    def build(cls, rows: tuple, batch_rows: list[int], batch_size: int) -> PenaltyPlan:
        bias = [(j, t, v) for j, r in enumerate(rows) for t, v in r.bias.items()]

        def column(attr: str, neutral: float):
            values = [getattr(r, attr) for r in rows]
            if all(v is None for v in values):
                return None
            return _column([neutral if v is None else v for v in values])

        return cls(
            rows=rows,
            batch_rows=batch_rows,
            index=_subset(batch_rows, batch_size),
            bias=tuple(mx.array(c) for c in zip(*bias)) if bias else None,
            repetition=column("repetition", 1.0),
            presence=column("presence", 0.0),
            frequency=column("frequency", 0.0),
        )


def _windows(contexts: list[mx.array]) -> tuple[mx.array, mx.array]:
    """Each row's last PENALTY_CONTEXT tokens, left-padded with token 0, and a weight that is
    1 for real tokens and 0 for padding (a padded slot then changes nothing)."""
    width = PENALTY_CONTEXT
    recent = [c[-width:] for c in contexts]
    lengths = [r.shape[0] for r in recent]
    tokens = mx.stack([r if n == width else mx.pad(r, (width - n, 0)) for r, n in zip(recent, lengths)])
    weight = (mx.arange(width)[None] >= mx.array([width - n for n in lengths])[:, None]).astype(mx.float32)
    return tokens, weight


def apply_penalties(logits: mx.array, plan: PenaltyPlan, contexts: list[mx.array]) -> mx.array:
    """mlx-lm's logit bias, then repetition, presence and frequency penalties, for all the
    plan's rows at once: the per-row processors' float operations, row for row."""
    x = logits if plan.index is None else logits[plan.index]
    if plan.bias is not None:
        x = x.at[plan.bias[0], plan.bias[1]].add(plan.bias[2].astype(x.dtype))
    tokens, weight = _windows(contexts)
    rows = mx.broadcast_to(mx.arange(tokens.shape[0])[:, None], tokens.shape)
    if plan.repetition is not None:
        recent = weight * (mx.arange(tokens.shape[1]) >= tokens.shape[1] - REPETITION_CONTEXT)
        seen = mx.zeros(x.shape, mx.float32).at[rows, tokens].add(recent) > 0
        penalty = plan.repetition.astype(x.dtype)
        x = mx.where(seen, mx.where(x < 0, x * penalty, x / penalty), x)
    if plan.presence is not None:
        seen = mx.zeros(x.shape, mx.float32).at[rows, tokens].add(weight) > 0
        x = mx.where(seen, x - plan.presence.astype(x.dtype), x)
    if plan.frequency is not None:
        # One subtraction per occurrence, as mlx-lm's scatter does it (not count * penalty).
        x = x.at[rows, tokens].subtract((weight * plan.frequency).astype(x.dtype))
    if plan.index is None:
        return x
    out = logits[:]  # item assignment rewrites the array object: leave the caller's alone
    out[plan.index] = x
    return out


# -- the step ----------------------------------------------------------------------------
class VectorGenerationBatch(GenerationBatch):
    """mlx-lm's generation batch with the per-row work of `_step` done batch-wide."""

    vectorized = True  # False: mlx-lm's own step (the per-row reference; for benchmarks)
    normalise_every_row = False  # True: log-softmax every row, as mlx-lm does (for benchmarks)
    _sample_plan: SamplePlan | None = None
    _penalty_plan: PenaltyPlan | None = None

    def batch_wide(self) -> bool:
        """Whether this batch's rows can be processed and sampled batch-wide (every row's
        sampler is a RowSampling); otherwise mlx-lm's own per-row step applies."""
        rows = self.samplers or ()
        return self.vectorized and bool(rows) and all(isinstance(r, RowSampling) for r in rows)

    def _step(self):
        if not self.batch_wide():
            return super()._step()
        rows = tuple(self.samplers)
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens

        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logits, token_context = self.process(logits, inputs)
        plan = self.plan(rows)
        logprobs = log_softmax(logits) if self.normalise_every_row else scores(logits, plan)
        self._next_tokens = self.sample(logprobs, rows, plan)
        self._next_logprobs = list(logprobs)
        # Step t+1 computes while the host reads step t's tokens (as mlx-lm's own step).
        mx.async_eval(self._next_tokens, self._next_logprobs, token_context)

        mx.eval(inputs, self._current_logprobs)
        inputs = inputs.tolist()
        for sti, ti in zip(self.tokens, inputs):
            sti.append(ti)
        return inputs, self._current_logprobs

    def plan(self, rows: tuple) -> SamplePlan:
        plan = self._sample_plan
        if plan is None or not _same(plan.rows, rows):
            plan = self._sample_plan = SamplePlan.build(rows)
        return plan

    def sample(self, logprobs: mx.array, rows: tuple, plan: SamplePlan | None = None) -> mx.array:
        try:
            return sample_rows(logprobs, plan or self.plan(rows))
        except Exception:  # values MLX refuses: row by row, so only the faulty row's guard trips
            heal_random_state()
            self._sample_plan = None
            return mx.concatenate([row(logprobs[e : e + 1]) for e, row in enumerate(rows)])

    def process(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list]:
        """Penalties and bias batch-wide; other processors (grammar masks) on their own rows
        only; rows without processors are untouched. Returns the logits and the contexts."""
        if not any(self.logits_processors):
            return logits, []
        contexts, penalized, penalty_rows, per_row = [], [], [], []
        for e, processors in enumerate(self.logits_processors):
            if not processors:
                continue
            context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
            contexts.append(context)
            if isinstance(processors[0], RowPenalties):
                penalized.append(e)
                penalty_rows.append(context)
                processors = processors[1:]
            if processors:
                per_row.append((e, context, processors))
        if penalized:
            logits = self._penalise(logits, penalized, penalty_rows)
        if per_row:
            rows = []
            for e, context, processors in per_row:
                row = logits[e : e + 1]
                for processor in processors:
                    row = processor(context, row)
                rows.append(row)
            logits = logits[:]
            logits[mx.array([e for e, _, _ in per_row])] = mx.concatenate(rows)
        return logits, contexts

    def _penalise(self, logits: mx.array, batch_rows: list[int], contexts: list[mx.array]) -> mx.array:
        objects = [self.logits_processors[e][0] for e in batch_rows]
        try:
            return apply_penalties(logits, self._penalties(objects, batch_rows), contexts)
        except Exception:  # row by row, so only the faulty row's guard trips
            heal_random_state()
            self._penalty_plan = None
            rows = [p(c, logits[e : e + 1]) for p, c, e in zip(objects, contexts, batch_rows)]
            out = logits[:]
            out[mx.array(batch_rows)] = mx.concatenate(rows)
            return out

    def _penalties(self, objects: list[RowPenalties], batch_rows: list[int]) -> PenaltyPlan:
        plan = self._penalty_plan
        key = tuple(objects)
        if plan is None or not _same(plan.rows, key) or plan.batch_rows != batch_rows:
            plan = self._penalty_plan = PenaltyPlan.build(key, batch_rows, len(self.uids))
        return plan
