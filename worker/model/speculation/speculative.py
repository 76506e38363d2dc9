"""Speculative decoding inside continuous batching: drafting and the policy that decides,
step by step, whether speculating pays (the verification step itself is in
worker/model/speculation/spec_verify.py).

- Drafting, by one of two drafters behind the same interface (propose drafts for some rows,
  forget rows that left the batch):
  - prompt lookup (no second model): a row's draft is what followed the most recent earlier
    occurrence of its last n tokens (n = max_ngram down to min_ngram) in its own prompt and
    output. Agents quote, copy and edit their context, so these drafts are often right.
  - a draft model (worker/model/speculation/draft_model.py): a smaller model sharing the tokenizer decodes the
    draft greedily from the row's context.
- Who speculates: greedy rows (temperature 0) without logits processors (penalties, bias,
  grammar, thinking budget) and without logprobs: for them accepting the draft prefix the
  model's own argmax agrees with is exactly non-speculative decoding. Other rows share the
  same forward pass with no draft (their first position is sampled as usual); they do not
  speculate (rejection sampling for sampled rows is not implemented).
- Per row: the draft length adapts to acceptance (grows after a fully accepted draft,
  shrinks to what was accepted otherwise) and a row whose drafts keep missing backs off.
- Per model: the time per emitted token of speculative steps is compared with that of
  plain steps at the same batch size (plain steps keep being sampled as probes); when
  speculation loses it pauses for a while (a doubling cooldown), then is tried again. Both
  kinds are timed the same way, from a step's start to the next one's: mlx-lm's
  BatchGenerator reads a prompt chunk after each decode step, and a plain step timed that
  way while a speculative one was timed around its verification alone made plain steps look
  dearer whenever prompts were being read, so speculation kept going while it lost (0.85x
  on the agent workload at c = 8 before, 1.05x after, bench/HISTORY.md at 3b9d616). A step that spans an
  idle gap is not a sample. Sizes share meters by powers of two, every other step is plain
  until a size's plain cost is known, and a speculative token 1.2x dearer than a plain one
  pauses after two steps of each.
- Per batch size: on the CPU device nothing speculates in a batch of more than
  CPU_MAX_ROWS rows (speculative.max_rows overrides it, on any device).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ....shared.model_sections import SpeculativeConfig
from ....shared.platform import on_cpu_device
from .spec_verify import Verified, needs_replay, rollback_supported, verify_step

PROBE_EVERY = 32  # a plain step this often while speculating, to keep its cost current
LEARNING_PROBE_EVERY = 2  # and every other step until a size's plain cost is known
MIN_SAMPLES = 8  # steps of each kind before the comparison is trusted
EARLY_SAMPLES = 2  # steps of each kind after which a clear loss already pauses
EARLY_LOSS = 1.2  # a speculative token dearer than this x a plain one is a clear loss
COOLDOWN_STEPS = (64, 2048)  # first and longest pause after speculation lost
EMA = 0.9  # weight of the past in the cost averages
GAP = 10.0  # a step timed at over GAP x its kind's average spanned an idle gap: not a sample
MAX_BACKOFF = 16  # steps a row waits before drafting again after repeated misses
# Drafted positions one verification may carry across the batch: a row drafts at most
# VERIFY_DRAFT_POSITIONS // rows tokens (at least 1). It caps the worst verification (32 rows
# x 9 positions was a 288-token forward); it did not make c = 16 pay (0.91x): a verification
# is as wide as its longest draft and on a CPU costs about that many plain steps at batch 16
# (bench/speculation/verify_width.py; bench/HISTORY.md at 3b9d616, "Speculation at c = 16 and 32").
VERIFY_DRAFT_POSITIONS = 64
# On the CPU device nothing speculates in a batch of more than this many rows unless the
# model's speculative.max_rows says otherwise (vLLM's speculative_disable_by_batch_size).
# Traced per step through the server (MLXGW_STEP_TRACE, bench/step/trace.py): on a CPU a
# verification costs about as much as the positions it feeds. Per token against a plain step
# of the same rows it cost 0.3-0.8x at 1 row, 0.64x at 2 (code edits, 3.3 tokens a row per
# verification), 0.96-1.38x at 4 (chat 1.8 tokens a row, code edits 1.5: with 4 rows some row
# has a draft almost every step, so the batch verifies while most rows gain one token) and
# 1.7-2.9x at 8-16. On / off through the server: 1.15-2.10x at c = 1, 1.27x on code edits at
# c = 2, and nothing gained at c = 4 in any workload (medians 0.89-1.01, code edits of 512
# tokens 0.95x): bench/README.md, "Speculation on against off". A GPU has no default cap.
CPU_MAX_ROWS = 2


def default_max_rows() -> int | None:
    """SpeculativeConfig.max_rows when unset: CPU_MAX_ROWS on the CPU device, else none."""
    return CPU_MAX_ROWS if on_cpu_device() else None


class NgramIndex:
    """The most recent end position of every n-gram of a growing token list."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = list(range(max_n, min_n - 1, -1))
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the last earlier occurrence of tokens' suffix."""
        last = len(tokens) - 1
        for end in range(self.indexed, last):  # never the suffix itself: it has no future yet
            for n in self.sizes:
                if end + 1 >= n:
                    self.ends[n][tuple(tokens[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in self.sizes:
            if last + 1 >= n:
                end = self.ends[n].get(tuple(tokens[last + 1 - n :]))
                if end is not None:
                    return tokens[end + 1 : end + 1 + k]
        return []


@dataclass
class DraftRequest:
    uid: int
    context: list[int]  # the row's tokens so far, ending with its pending (not yet fed) token
    k: int  # tokens to draft, at most


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's draft (possibly empty), in order."""
        ...

    def retain(self, live: set[int]) -> None:
        """Drop what is kept for rows no longer in the batch (they never come back)."""
        ...


@dataclass
class PromptLookupDrafter:
    min_ngram: int
    max_ngram: int
    indices: dict[int, NgramIndex] = field(default_factory=dict)  # uid -> its context's n-grams

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = []
        for r in requests:
            index = self.indices.get(r.uid)
            if index is None:
                index = self.indices[r.uid] = NgramIndex(self.min_ngram, self.max_ngram)
            drafts.append(index.propose(r.context, r.k))
        return drafts

    def retain(self, live: set[int]) -> None:
        if len(self.indices) > len(live):
            self.indices = {uid: i for uid, i in self.indices.items() if uid in live}


@dataclass
class RowState:
    draft_len: int
    misses: int = 0
    skip: int = 0  # steps left before this row drafts again


@dataclass
class CostMeter:
    """Seconds and emitted tokens, exponentially averaged, for one kind of step."""

    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        if self.samples >= MIN_SAMPLES and seconds > GAP * self.seconds / (1 - EMA**self.samples):
            return  # the batch went idle (or only read prompts) after this step (the EMA starts at 0)
        self.seconds = EMA * self.seconds + (1 - EMA) * seconds
        self.tokens = EMA * self.tokens + (1 - EMA) * tokens
        self.samples += 1

    def per_token(self, min_samples: int = MIN_SAMPLES) -> float | None:
        return self.seconds / self.tokens if self.samples >= min_samples and self.tokens > 0 else None


def size_bucket(rows: int) -> int:
    """Batch sizes share cost meters by powers of two: at c = 32 the batch passes through
    every size as rows finish and arrive, and a meter per size needing MIN_SAMPLES steps of
    each kind kept speculation in its learning phase for a whole wave (0.45x at c = 32)."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class Counters:
    drafted: int = 0
    accepted: int = 0
    speculative_steps: int = 0
    plain_steps: int = 0
    emitted_in_speculative_steps: int = 0
    pauses: int = 0
    largest_verification: int = 0  # drafted positions of the largest verification so far


@dataclass
class Speculator:
    config: SpeculativeConfig
    drafter: Drafter | None = None  # mode draft: a DraftModelDrafter; else made from the config
    rows: dict[int, RowState] = field(default_factory=dict)  # uid -> state, eligible rows only
    counters: Counters = field(default_factory=Counters)
    plain_cost: dict[int, CostMeter] = field(default_factory=dict)  # by batch size
    spec_cost: dict[int, CostMeter] = field(default_factory=dict)
    steps: int = 0
    paused_until: int = 0
    cooldown: int = COOLDOWN_STEPS[0]
    _open: tuple | None = None  # (meters, batch size, started, tokens) of the step before this one
    max_rows: int | None = field(init=False, default=None)  # from the config or the device: above it, no speculation

    def __post_init__(self) -> None:
        if self.drafter is None and self.config.mode == "prompt_lookup":
            self.drafter = PromptLookupDrafter(self.config.min_ngram, self.config.max_ngram)
        self.max_rows = self.config.max_rows or default_max_rows()

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off" and self.drafter is not None

    def attach(self, generator) -> None:
        """Route the generator's decode step through this speculator. BatchGenerator keeps
        one GenerationBatch for its whole life (new rows are merged into it), so wrapping
        that object's next() covers every decode step; prefill is untouched."""
        batch = generator.decode_batch
        plain_next = batch.next
        batch.next = lambda: self.next(batch, plain_next)

    def admit(self, uid: int, eligible: bool) -> None:
        if self.enabled and eligible:
            self.rows[uid] = RowState(self.config.max_draft)

    # -- the step ---------------------------------------------------------------------------
    def next(self, batch, plain_next) -> list:
        self.steps += 1
        if len(self.rows) > 4 * max(1, len(batch.uids)):
            self._forget_gone(batch)
        if self.drafter is not None:  # a draft model's per-row KV is freed as soon as its row ends
            self.drafter.retain(set(batch.uids))
        if not self._worth_trying(batch):
            return self._plain(batch, plain_next)
        pending = batch._next_tokens.tolist()  # waits for a plain step still computing
        self._close_step(time.perf_counter())
        drafts = self._drafts(batch, pending)
        # Where a rejection replays (recurrent or sliding-window layers), every row keeps as
        # many tokens as the row that kept fewest: a row without a draft would waste the pass.
        if not any(drafts) or (not all(drafts) and needs_replay(batch.prompt_cache)):
            return self._plain(batch, plain_next)
        states = [self.rows.get(uid) for uid in batch.uids]  # before finished rows leave the batch
        started = time.perf_counter()
        responses, verified = verify_step(batch, pending, drafts)
        self._record(verified)
        self._open = (self.spec_cost, size_bucket(len(drafts)), started, verified.emitted)  # closed at the next step
        self._adapt(states, drafts, verified)
        return responses

    def _worth_trying(self, batch) -> bool:
        if self.max_rows is not None and len(batch.uids) > self.max_rows:
            return False
        if not self.rows or self.steps < self.paused_until or self._probe_due(size_bucket(len(batch.uids))):
            return False
        return any(uid in self.rows for uid in batch.uids) and rollback_supported(batch.prompt_cache)

    def _probe_due(self, size: int) -> bool:
        """A plain step now, to measure what speculation competes with: every other step
        until a size's plain cost is known, then now and then."""
        samples = self.plain_cost.get(size, CostMeter()).samples
        return self.steps % (PROBE_EVERY if samples >= MIN_SAMPLES else LEARNING_PROBE_EVERY) == 0

    def _plain(self, batch, plain_next) -> list:
        self._close_step(time.perf_counter())
        rows, started = len(batch.uids), time.perf_counter()
        responses = plain_next()
        self.counters.plain_steps += 1
        self._open = (self.plain_cost, size_bucket(rows), started, rows)
        return responses

    def _close_step(self, now: float) -> None:
        """The step before this one cost the time since it started: a plain step's tokens are
        computed asynchronously, and whatever the generator did after either kind (a prompt
        chunk) is counted alike. A speculative step's cost is then compared with plain's."""
        if self._open is None:
            return
        meters, size, started, tokens = self._open
        self._open = None
        meters.setdefault(size, CostMeter()).add(now - started, tokens)
        if meters is self.spec_cost:
            self._judge(size)

    def _drafts(self, batch, pending: list[int]) -> list[list[int]]:
        """Every row's draft for this step (empty for rows that do not speculate now)."""
        drafts: list[list[int]] = [[] for _ in pending]
        asked, requests = [], []
        for i, x in enumerate(pending):
            request = self._request(batch, i, x)
            if request is not None:
                asked.append(i)
                requests.append(request)
        if requests:
            for i, draft in zip(asked, self.drafter.propose(requests)):
                drafts[i] = draft
        return drafts

    def _request(self, batch, i: int, pending: int) -> DraftRequest | None:
        uid = batch.uids[i]
        state = self.rows.get(uid)
        if state is None:
            return None
        if state.skip:
            state.skip -= 1
            return None
        room = batch.max_tokens[i] - batch._num_tokens[i] - 1  # never draft past max_tokens
        if room <= 0:
            return None
        share = max(1, VERIFY_DRAFT_POSITIONS // len(batch.uids))
        return DraftRequest(uid, batch.tokens[i] + [pending], min(state.draft_len, room, share))

    def _record(self, verified: Verified) -> None:
        c = self.counters
        c.speculative_steps += 1
        c.drafted += sum(verified.drafted)
        c.accepted += sum(verified.accepted)
        c.emitted_in_speculative_steps += verified.emitted
        c.largest_verification = max(c.largest_verification, sum(verified.drafted))

    def _judge(self, size: int) -> None:
        spec_meter, plain_meter = self.spec_cost.get(size, CostMeter()), self.plain_cost.get(size, CostMeter())
        early_spec, early_plain = spec_meter.per_token(EARLY_SAMPLES), plain_meter.per_token(EARLY_SAMPLES)
        if early_spec is not None and early_plain is not None and early_spec > EARLY_LOSS * early_plain:
            self._pause(size)  # a clear loss after two steps: not six more of it
            return
        spec, plain = spec_meter.per_token(), plain_meter.per_token()
        if spec is not None and plain is not None:
            if spec > plain:
                self._pause(size)
            else:
                self.cooldown = COOLDOWN_STEPS[0]

    def _pause(self, size: int) -> None:
        self.counters.pauses += 1
        self.paused_until = self.steps + self.cooldown
        self.cooldown = min(2 * self.cooldown, COOLDOWN_STEPS[1])
        self.spec_cost.pop(size, None)  # judged afresh when it is tried again

    def _adapt(self, states: list[RowState | None], drafts: list[list[int]], verified: Verified) -> None:
        """Per-row draft length and back-off, from this step's acceptance."""
        for draft, accepted, state in zip(drafts, verified.accepted, states):
            if not draft or state is None:
                continue
            if accepted == len(draft):
                state.draft_len = min(self.config.max_draft, state.draft_len + 2)
            else:
                state.draft_len = max(1, accepted + 1)
            if accepted == 0:
                state.misses += 1
                state.skip = min(2 ** (state.misses - 1), MAX_BACKOFF) - 1
            else:
                state.misses = 0

    def _forget_gone(self, batch) -> None:
        live = set(batch.uids)
        self.rows = {uid: s for uid, s in self.rows.items() if uid in live}

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return {
            "mode": self.config.mode,
            **({"draft_model": self.config.draft_model} if self.config.mode == "draft" else {}),
            "active": self.enabled and self.steps >= self.paused_until,
            "drafted_tokens": c.drafted,
            "accepted_tokens": c.accepted,
            "acceptance_rate": round(c.accepted / c.drafted, 4) if c.drafted else None,
            "speculative_steps": c.speculative_steps,
            "plain_steps": c.plain_steps,
            "tokens_per_speculative_step": (
                round(c.emitted_in_speculative_steps / c.speculative_steps, 3) if c.speculative_steps else None
            ),
            "pauses": c.pauses,
        }
