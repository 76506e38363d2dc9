"""Speculative decoding inside continuous batching: drafting and the policy that decides,
step by step, whether speculating pays (the verification step itself is in
worker/spec_verify.py).

- Drafting, by one of two drafters behind the same interface (propose drafts for some rows,
  forget rows that left the batch):
  - prompt lookup (no second model): a row's draft is what followed the most recent earlier
    occurrence of its last n tokens (n = max_ngram down to min_ngram) in its own prompt and
    output. Agents quote, copy and edit their context, so these drafts are often right.
  - a draft model (worker/draft_model.py): a smaller model sharing the tokenizer decodes the
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
  on the agent workload at c = 8 before, 1.05x after, bench/README.md). A step that spans an
  idle gap is not a sample. Sizes share meters by powers of two, every other step is plain
  until a size's plain cost is known, and a speculative token 1.2x dearer than a plain one
  pauses after two steps of each.
- Per step: how wide the verification is, if there is one (worker/spec_cost.py). The
  drafts in hand, each row's acceptance so far (scaled by what verifications delivered
  against such estimates) and the measured cost of a verified position at this batch size
  give the expected tokens per second of every width; the step verifies at the best one
  only if it beats a plain step by a margin. A CPU pays for every position
  of the rows x width rectangle, so at c = 16 a few rows' short drafts no longer make every
  row pay a wide pass (0.91x before); where positions are nearly free (a GPU at small
  batches) the learned slope is near zero and drafts are verified whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from mlxgw.shared.config import SpeculativeConfig

from .spec_cost import (
    MIN_SAMPLES,
    ROW_PRIOR,
    Acceptance,
    Calibration,
    CostMeter,
    HitRate,
    WidthCost,
    choose_width,
    expected_tokens,
    size_bucket,
    slope_near,
)
from .spec_verify import Verified, needs_replay, rollback_supported, verify_step

PROBE_EVERY = 32  # a plain step this often while speculating, to keep its cost current
LEARNING_PROBE_EVERY = 2  # and every other step until a size's plain cost is known
EARLY_SAMPLES = 2  # steps of each kind after which a clear loss already pauses
EARLY_LOSS = 1.2  # a speculative token dearer than this x a plain one is a clear loss
COOLDOWN_STEPS = (64, 2048)  # first and longest pause after speculation lost
# After this many declined steps in a row at a batch size, one verification of width 2 is
# taken anyway: a slope, acceptance or calibration learned from noisy steps would otherwise
# never be corrected (one step in EXPLORE_AFTER, 1.4x a plain one at batch 16 on a CPU).
EXPLORE_AFTER = 128
MAX_BACKOFF = 16  # steps a row waits before drafting again after repeated misses
# Drafted positions one verification may carry across the batch: a row drafts at most
# VERIFY_DRAFT_POSITIONS // rows tokens (at least 1). It caps the worst verification (32 rows
# x 9 positions was a 288-token forward). Whether a narrower verification, or none, pays is
# choose_width's question (worker/spec_cost.py).
VERIFY_DRAFT_POSITIONS = 64
# On the CPU device nothing speculates in a batch of more than this many rows unless the
# model's speculative.max_rows says otherwise: at 16 rows it lost 9-13% through the server
# with every policy tried (bench/README.md, "Speculation at c = 16 and 32"), at 8 and below
# its paired medians were >= 1.0.
CPU_MAX_ROWS = 8


def default_max_rows() -> int | None:
    """SpeculativeConfig.max_rows when unset: CPU_MAX_ROWS on the CPU device, else none."""
    import mlx.core as mx

    return CPU_MAX_ROWS if mx.default_device().type == mx.cpu else None


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
    acceptance: Acceptance = field(default_factory=Acceptance)
    found: HitRate = field(default_factory=HitRate)


class OpenStep(NamedTuple):
    """A step whose cost is known once the next one starts."""

    meters: dict  # plain_cost or spec_cost
    size: int  # its batch-size bucket
    started: float
    tokens: int  # emitted
    rows: int = 0  # a verification's rows and positions beyond each row's first
    extra_positions: int = 0


@dataclass
class Counters:
    drafted: int = 0
    accepted: int = 0
    speculative_steps: int = 0
    plain_steps: int = 0
    emitted_in_speculative_steps: int = 0
    pauses: int = 0
    largest_verification: int = 0  # drafted positions of the largest verification so far
    declined: int = 0  # steps where no verification width was expected to pay for the drafts
    asked_steps: int = 0  # steps that asked the drafter (each drains mlx-lm's one-step-ahead pipeline)


@dataclass
class Speculator:
    config: SpeculativeConfig
    drafter: Drafter | None = None  # mode draft: a DraftModelDrafter; else made from the config
    rows: dict[int, RowState] = field(default_factory=dict)  # uid -> state, eligible rows only
    counters: Counters = field(default_factory=Counters)
    plain_cost: dict[int, CostMeter] = field(default_factory=dict)  # by batch size
    spec_cost: dict[int, CostMeter] = field(default_factory=dict)
    width_cost: dict[int, WidthCost] = field(default_factory=dict)  # by batch size
    acceptance: Acceptance = field(default_factory=Acceptance)  # every row's drafts, decayed by step
    declined_in_a_row: dict[int, int] = field(default_factory=dict)  # by batch size
    calibration: Calibration = field(default_factory=Calibration)
    found: HitRate = field(default_factory=HitRate)  # every row's asks, decayed by step
    steps: int = 0
    paused_until: int = 0
    cooldown: int = COOLDOWN_STEPS[0]
    _open: OpenStep | None = None  # the step before this one

    max_rows: int | None = None  # the batch size above which nothing speculates

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
        batch = generator._generation_batch
        plain_next = batch.next
        batch.next = lambda: self.next(batch, plain_next)

    def admit(self, uid: int, eligible: bool) -> None:
        if self.enabled and eligible:
            self.rows[uid] = RowState(self.config.max_draft)

    # -- the step ---------------------------------------------------------------------------
    def next(self, batch, plain_next) -> list:
        self.steps += 1
        self.acceptance.decay()
        self.found.decay()
        if len(self.rows) > 4 * max(1, len(batch.uids)):
            self._forget_gone(batch)
        if self.drafter is not None:  # a draft model's per-row KV is freed as soon as its row ends
            self.drafter.retain(set(batch.uids))
        if not self._worth_trying(batch):
            return self._plain(batch, plain_next)
        states = [self.rows.get(uid) for uid in batch.uids]  # before finished rows leave the batch
        uniform = needs_replay(batch.prompt_cache)
        size = size_bucket(len(states))
        exploring = self.declined_in_a_row.get(size, 0) >= EXPLORE_AFTER
        rates = self._rates(states)
        asks = [self._asks(s, len(states)) for s in states]
        if not exploring and self._width(asks, rates, uniform, self._finds(states)) == 1:
            return self._decline(batch, plain_next, size)  # drafts as long as asked, as often as found, would not pay
        if exploring:
            self.declined_in_a_row[size] = 0  # whether or not anything is found: one try
        pending = batch._next_tokens.tolist()  # waits for a plain step still computing
        self._close_step(time.perf_counter())
        drafts = self._drafts(batch, pending)
        # Where a rejection replays (recurrent or sliding-window layers), every row keeps as
        # many tokens as the row that kept fewest: a row without a draft would waste the pass.
        if not any(drafts) or (not all(drafts) and uniform):
            return self._plain(batch, plain_next)
        width = 2 if exploring else self._width([len(d) for d in drafts], rates, uniform)
        if width == 1:
            return self._decline(batch, plain_next, size)
        self.declined_in_a_row[size] = 0
        drafts = [d[: width - 1] for d in drafts]
        started = time.perf_counter()
        responses, verified = verify_step(batch, pending, drafts)
        self._record(verified)
        rows = len(drafts)
        expected = expected_tokens([len(d) for d in drafts], rates, width, uniform)
        self.calibration.add(expected - rows, verified.emitted - rows)  # closed at the next step:
        self._open = OpenStep(self.spec_cost, size_bucket(rows), started, verified.emitted, rows, rows * (width - 1))
        self._adapt(states, drafts, verified)
        return responses

    def _decline(self, batch, plain_next, size: int) -> list:
        self.counters.declined += 1
        self.declined_in_a_row[size] = self.declined_in_a_row.get(size, 0) + 1
        return self._plain(batch, plain_next)

    def _rates(self, states: list[RowState | None]) -> list[float]:
        """Each row's chance of a drafted token holding up, its own history weighed against all rows'."""
        overall = self.acceptance.rate()
        return [s.acceptance.rate(overall, ROW_PRIOR) if s else overall for s in states]

    def _finds(self, states: list[RowState | None]) -> list[float]:
        """Each row's chance of the drafter finding a draft when asked."""
        overall = self.found.rate()
        return [s.found.rate(overall, ROW_PRIOR) if s else overall for s in states]

    def _width(self, lengths: list[int], rates: list[float], uniform: bool, found: list[float] | None = None) -> int:
        """The verification's width for drafts of these lengths: what they are expected to
        emit per second at this batch's measured cost of a position, against a plain step."""
        size = size_bucket(len(lengths))
        plain = self.plain_cost.get(size, CostMeter()).per_token(EARLY_SAMPLES)
        step_seconds = plain * len(lengths) if plain is not None else None
        slope = slope_near(self.width_cost, size)
        return choose_width(lengths, rates, step_seconds, slope, uniform, self.calibration.ratio(), found)

    @staticmethod
    def _asks(state: RowState | None, rows: int) -> int:
        """The most a row would draft this step (the drafter may find fewer)."""
        if state is None or state.skip:
            return 0
        return min(state.draft_len, max(1, VERIFY_DRAFT_POSITIONS // rows))

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
        self._open = OpenStep(self.plain_cost, size_bucket(rows), started, rows)
        return responses

    def _close_step(self, now: float) -> None:
        """The step before this one cost the time since it started: a plain step's tokens are
        computed asynchronously, and whatever the generator did after either kind (a prompt
        chunk) is counted alike. A speculative step's cost is then compared with plain's."""
        if self._open is None:
            return
        step, self._open = self._open, None
        seconds = now - step.started
        counted = step.meters.setdefault(step.size, CostMeter()).add(seconds, step.tokens)
        if step.meters is self.spec_cost and counted:
            plain = self.plain_cost.get(step.size, CostMeter()).per_token(EARLY_SAMPLES)
            if plain is not None and step.extra_positions:
                excess = seconds - plain * step.rows
                self.width_cost.setdefault(step.size, WidthCost()).add(step.extra_positions, excess)
            self._judge(step.size)

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
            self.counters.asked_steps += 1
            for i, draft in zip(asked, self.drafter.propose(requests)):
                drafts[i] = draft
                self.found.add(bool(draft))
                if (state := self.rows.get(batch.uids[i])) is not None:
                    state.found.add(bool(draft))
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
        return DraftRequest(uid, batch.tokens[i] + [pending], min(self._asks(state, len(batch.uids)), room))

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
            self.acceptance.add(accepted, len(draft))
            state.acceptance.add(accepted, len(draft))
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
            "declined_steps": c.declined,
            "asked_steps": c.asked_steps,
            "calibration": round(self.calibration.ratio(), 3),
            "largest_verification": c.largest_verification,
        }
