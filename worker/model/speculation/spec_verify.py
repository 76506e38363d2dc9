"""One speculative decode step of mlx-lm's GenerationBatch: every row feeds its pending token
plus its own draft in one batched forward pass, keeps the longest draft prefix the model
itself would have chosen greedily, and the rejected KV is rolled back per row.

The step mirrors GenerationBatch._step + next() (mlx-lm 0.32.2) so that the batch's state
stays what mlx-lm expects between steps: `tokens[i]` is exactly the tokens in row i's KV,
`_next_tokens` holds each row's pending (sampled, not yet fed) token, and the row's first
position goes through its own logits processors and sampler as in a plain step. Rows
without a draft (sampled, constrained, logprobs) take that first position only.

KV rollback on a BatchKVCache. The cache is one (B, heads, capacity, dim) buffer per layer
with a shared write index `_idx`; row b's tokens are the columns [left_padding[b], _idx),
right-aligned, and its position (RoPE) is `offset[b] = _idx - left_padding[b]`. After a
pass of W tokens row b keeps k_b = 1 + accepted_b of them. There is no per-row end, so:
- trim every layer by W - max(k): `_idx` then ends where the best row's tokens end;
- each row that kept fewer (shift s_b = max(k) - k_b) is rolled right by s_b within
  [0, _idx): its rejected tail wraps into columns [0, s_b), which become left padding
  (left_padding += s_b, offset -= s_b), so the mask hides them and RoPE positions stay right.
When every row keeps the same count (a single request always does) the trim alone is exact
and nothing moves. The roll copies the shifted rows' KV once, about the bytes one attention
pass reads for them: the cost the acceptance policy weighs (worker/model/speculation/speculative.py).

Layers that cannot be cut back (a sliding window's BatchRotatingKVCache, a recurrent
ArraysCache, a CacheList holding one) are snapshotted before the pass. When a row rejects
part of its draft, every layer goes back to its state before the pass (KV layers trimmed by
the pass's width, the others restored from the snapshot) and the tokens every row kept are
fed again in one pass, so the state holds exactly the accepted tokens. Every row keeps the
same count there (the fewest any row kept; a row's accepted tokens past it are simply
drafted again later): a right-padded replay would need each recurrent layer to honour the
padding, and some of mlx-lm's do not (nemotron_h's SSM ignores the lengths). Fully
accepted steps need no second pass."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, dynamic_roll

from ....shared.events import FinishReason
from ..cache.quantized_kv import BatchQuantizedKVCache
from ..runners.batch_sampler import scores

CUTTABLE = (BatchKVCache, BatchQuantizedKVCache)  # cut back per row
RESTORABLE = (BatchRotatingKVCache, ArraysCache)  # snapshotted and replayed, not cut


def _leaves(caches: list) -> list:
    out = []
    for c in caches:
        out.extend(_leaves(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


def rollback_supported(caches: list) -> bool:
    """Whether a speculative step can be undone on these batch caches: KV layers are cut per
    row; rotating windows and recurrent states are restored and the kept tokens replayed."""
    return bool(caches) and all(type(c) in CUTTABLE or type(c) in RESTORABLE for c in _leaves(caches))


def needs_replay(caches: list) -> bool:
    """Whether undoing a rejected draft replays the kept tokens (some layer cannot be cut)."""
    return any(type(c) not in CUTTABLE for c in _leaves(caches))


def _copy(value):
    if isinstance(value, mx.array):
        return mx.array(value)  # a new array object: in-place updates of the live one miss it
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def snapshot_states(caches: list) -> list[tuple]:
    """The attributes of every non-KV layer, as they are before a speculative pass."""
    return [(c, {k: _copy(v) for k, v in vars(c).items()}) for c in _leaves(caches) if type(c) not in CUTTABLE]


def replay_rows(batch, inputs: mx.array, width: int, kept: int, saved: list[tuple]) -> None:
    """Undo a pass of `width` tokens on every layer, then feed every row's first `kept`."""
    for c in _leaves(batch.prompt_cache):
        if type(c) in CUTTABLE:
            c.trim(width)
    for c, attrs in saved:
        vars(c).update(attrs)
    batch.model(inputs[:, :kept], cache=batch.prompt_cache)
    mx.eval([a for c in _leaves(batch.prompt_cache) for a in _state_arrays(c)])


def _state_arrays(cache) -> list:
    return [a for a in (cache.state if isinstance(cache.state, (list, tuple)) else []) if isinstance(a, mx.array)]


def _parts(buf) -> tuple:
    return buf if isinstance(buf, tuple) else (buf,)


def rollback_rows(caches: list, width: int, kept: list[int]) -> None:
    """Drop the last width - kept[b] positions of each row b from every layer's cache."""
    most = max(kept)
    for c in caches:
        c.trim(width - most)
    shifts = [most - k for k in kept]
    if not any(shifts):
        return
    rows = mx.array([b for b, s in enumerate(shifts) if s])
    row_shifts = mx.array([s for s in shifts if s])[:, None]
    grow = mx.array(shifts)
    for c in caches:
        end = c._idx
        # A quantized layer holds each of keys and values as three arrays: roll each.
        for buf in (*_parts(c.keys), *_parts(c.values)):
            buf[rows, :, :end, :] = dynamic_roll(buf[rows, :, :end, :], row_shifts, axis=2)
        c.left_padding = c.left_padding + grow
        c.offset = c.offset - grow


@dataclass
class Verified:
    """What a speculative step did for the acceptance policy: per row, drafted and accepted."""

    drafted: list[int]
    accepted: list[int]
    emitted: int


def _first_position(batch, inputs: mx.array, logits: mx.array) -> tuple[mx.array, mx.array, list]:
    """The rows' first position exactly as GenerationBatch._step treats a decode step:
    logits processors (with the row's token context), normalization, the rows' samplers.
    A VectorGenerationBatch (worker/model/runners/batch_sampler.py) does both batch-wide, with its
    row-by-row fallbacks for a faulty row; mlx-lm's own batch, row by row."""
    if getattr(batch, "batch_wide", lambda: False)():
        logits, token_context = batch.process(logits, inputs)
        rows = tuple(batch.samplers)
        plan = batch.plan(rows)
        logprobs = scores(logits, plan)
        return batch.sample(logprobs, rows, plan), logprobs, token_context
    token_context = []
    if any(batch.logits_processors):
        processed = []
        for e in range(len(batch.uids)):
            row = logits[e : e + 1]
            processors = batch.logits_processors[e] or ()
            if processors:
                context = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in processors:
                    row = processor(context, row)
            processed.append(row)
        logits = mx.concatenate(processed, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [batch.fallback_sampler if s is None else s for s in (batch.samplers or [None] * len(batch.uids))]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else batch.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
    return sampled, logprobs, token_context


def _accepted(draft: list[int], choices: list[int]) -> int:
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    return n


def verify_step(batch, pending: list[int], drafts: list[list[int]]) -> tuple[list, Verified]:
    """Run one speculative step on `batch` (a GenerationBatch whose pending tokens are
    `pending`); return its Responses (several per row when drafts were accepted, in order)."""
    width = 1 + max(len(d) for d in drafts)
    rows = [[x] + d + [0] * (width - 1 - len(d)) for x, d in zip(pending, drafts)]
    inputs = mx.array(rows, dtype=batch._next_tokens.dtype)
    saved = snapshot_states(batch.prompt_cache) if needs_replay(batch.prompt_cache) else None
    logits = batch.model(inputs, cache=batch.prompt_cache)
    sampled, first_logprobs, token_context = _first_position(batch, inputs[:, 0], logits[:, 0, :])
    # Greedy choices the way the batched step makes them: the argmax of the logits (a drafting
    # row never reports log-probabilities, so its accepted tokens' values are not normalised:
    # that would be a full-vocabulary exp at every drafted position).
    all_logprobs = logits
    greedy = mx.argmax(all_logprobs, axis=-1)
    mx.eval(sampled, greedy, token_context)
    sampled_l, greedy_l = sampled.tolist(), greedy.tolist()
    accepted = [_accepted(d, g) for d, g in zip(drafts, greedy_l)]
    if saved is None:
        rollback_rows(batch.prompt_cache, width, [1 + a for a in accepted])
    else:
        uniform = 1 + min(accepted)
        accepted = [uniform - 1] * len(accepted)
        if uniform < width:
            replay_rows(batch, inputs, width, uniform, saved)

    emitted_lp = batch._next_logprobs  # the log-probabilities each pending token was chosen from
    next_tokens, next_logprobs = [], []
    for b, a in enumerate(accepted):
        if a:
            next_tokens.append(greedy_l[b][a])
            next_logprobs.append(all_logprobs[b, a])
        else:  # the row's own sampler's choice, as a plain step would make it
            next_tokens.append(sampled_l[b])
            next_logprobs.append(first_logprobs[b])
    batch._current_tokens = inputs[:, 0]
    batch._current_logprobs = emitted_lp
    batch._next_tokens = mx.array(next_tokens, dtype=inputs.dtype)
    batch._next_logprobs = next_logprobs
    responses = _responses(batch, pending, drafts, accepted, emitted_lp, all_logprobs)
    emitted = sum(1 + a for a in accepted)
    return responses, Verified([len(d) for d in drafts], accepted, emitted)


def _responses(batch, pending, drafts, accepted, emitted_lp, all_logprobs) -> list:
    """GenerationBatch.next()'s bookkeeping over several tokens per row: count each against
    max_tokens, run the stop matchers, and end the row at the first finish, so no token past
    it is emitted. The row's KV (and so `tokens`) may hold accepted tokens past that point;
    they are the model's own greedy continuation, kept consistent for the prefix cache."""
    responses, keep = [], []
    for b, a in enumerate(accepted):
        emitted = [pending[b]] + drafts[b][:a]
        batch.tokens[b].extend(emitted)
        finish = None
        for j, token in enumerate(emitted):
            batch._num_tokens[b] += 1
            if batch._num_tokens[b] >= batch.max_tokens[b]:
                finish = FinishReason.LENGTH
            if batch._matchers[b].advance(token):
                finish = FinishReason.STOP
            logprobs = emitted_lp[b] if j == 0 else all_logprobs[b, j - 1]
            ended = finish is not None
            responses.append(
                batch.Response(
                    uid=batch.uids[b],
                    token=token,
                    logprobs=logprobs,
                    finish_reason=finish,
                    prompt_cache=batch.extract_cache(b) if ended else None,
                    all_tokens=batch.tokens[b] if ended else None,
                )
            )
            if ended:
                break
        if finish is None:
            keep.append(b)
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    return responses
