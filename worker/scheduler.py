"""Admission and lifecycle policy for one model's requests (the runner executes).

- a request is checked against the model (request_checks), then prepared (chat template,
  tokenizing, constraint) off the engine thread when a Preprocessor is given;
- bounded waiting queue (`max_queue`): past it a request is refused as overloaded;
- at most `max_num_seqs` sequences run; new ones are admitted at step boundaries, by
  priority class, then fair share between tenants (API keys), then arrival
  (worker/fair_share.py); a request starved beyond a bound preempts a row held beyond its
  tenant's share (paused with its KV in the prefix cache, resumed where it stopped);
- each step reads at most `prefill_budget` prompt tokens (padding included) across the rows
  still prefilling, and admits new prompts only while that budget is shared fairly
  (worker/prefill_plan.py): decoding rows never wait for more than one decode step plus one
  budget of prefill, and a short prompt does not wait for a long one to finish; with no row
  decoding, a step may read IDLE_BUDGET_FACTOR budgets (a burst starts in one step);
- a request ends exactly once: finish (stop / length / cancelled) or error (timeout, ...);
  cancelled and timed-out sequences leave the runner, and so free their KV, at once;
- a fault of one sequence (an exception while preparing, admitting, sampling, constraining
  or detokenizing it) ends that sequence with an error and leaves the batch running.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError, invalid

from .budget import ThinkingBudget, check_budget
from .choices import MAX_CHOICES, ChoiceGroups
from .fair_share import FairQueue, Row, Waiting, clean_weight
from .interfaces import TextRunner
from .isolation import SequenceGuard, as_service_error
from .output_parser import OutputParser, Parsed
from .prefill_plan import PrefillPace, admit_count, chunk_for, prefill_bound
from .preprocess import Preprocessor
from .request_checks import check_generate

log = logging.getLogger("mlxgw.worker")

IDLE_BUDGET_FACTOR = 4  # prompt budget of a step when no row is decoding (nobody waits on it)

Event = p.Event


def _parts(parsed: Parsed) -> dict:
    """The non-empty parts of a delta: text always (possibly empty), the rest when present."""
    return {"text": parsed.text, "reasoning": parsed.reasoning or None, "tool_calls": parsed.tool_calls or None}


@dataclass
class Prepared:
    """What preparation makes of a request: its prompt and the per-sequence helpers."""

    prompt: list[int]
    max_tokens: int
    parser: OutputParser | None
    constraint: object | None


@dataclass
class Sequence:
    req: p.GenerateRequest
    prompt: list[int]
    max_tokens: int
    arrived: float
    deadline: float | None
    text: object  # TextStream
    guard: SequenceGuard
    phase: str = "queued"  # queued -> prefill -> decode
    uid: int | None = None
    cached_tokens: int = 0
    prefilled: int = 0  # prompt tokens past the cached ones computed so far (progress)
    to_prefill: int = 0  # prompt tokens the runner still has to read before the last one
    generated: int = 0
    first_token_at: float | None = None
    parser: OutputParser | None = None  # splits reasoning and tool calls out of the text
    constraint: object | None = None  # logits processor enforcing a grammar
    unsent: Parsed = field(default_factory=Parsed)
    unsent_tokens: int = 0
    unsent_logprobs: list[dict] = field(default_factory=list)
    sent_delta: bool = False  # the first delta carries cached_tokens
    scorer: object | None = None  # a PromptScorer until its prompt logprobs are computed
    arrival: int = 0  # its place in the queue (kept when a preempted row re-queues)
    tokens: list[int] = field(default_factory=list)  # generated so far: a resumed row's prompt grows by them
    paused: int = 0  # times preempted

    def preemptible(self) -> bool:
        """Rows that can resume exactly from prompt + generated tokens: no grammar or
        per-token state outside the tokens, no sibling choices, no images to re-encode."""
        req = self.req
        return (
            self.constraint is None
            and req.logprobs is None
            and req.n == 1
            and not req.images
            and self.scorer is None
            and self.paused < 3
        )

    def usage(self) -> p.Usage:
        return p.Usage(len(self.prompt), self.generated, self.cached_tokens)


@dataclass
class _Intake:
    """A request between submit and admission, while it is prepared."""

    req: p.GenerateRequest
    arrival: int
    arrived: float


class Scheduler:
    request_type = p.GenerateRequest

    def __init__(
        self,
        runner: TextRunner,
        *,
        max_num_seqs: int,
        max_queue: int,
        policy: str = "clamp",
        preprocessor: Preprocessor | None = None,
        prefill_budget: int | None = None,
        capacity: dict | None = None,
        idle_budget_factor: int = IDLE_BUDGET_FACTOR,
        pace: PrefillPace | None = None,
        fair: FairQueue | None = None,
    ):
        """preprocessor: prepares requests on its own thread; None prepares them in submit
        (in-process tests and benchmarks). prefill_budget: prompt tokens per step across
        the prefilling rows (None: every admitted prompt reads the runner's own chunk per
        step); used only with runners that take a chunk size (set_prefill_chunk).
        capacity: how max_num_seqs was chosen (worker/capacity.py), for stats.
        pace: how fast this host reads prompts, which caps a step's budget so that no step
        runs long enough to look hung (worker/prefill_plan.py).
        fair: the waiting queue and its policy (worker/fair_share.py; tests set its bound)."""
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.prefill_budget = prefill_budget if hasattr(runner, "set_prefill_chunk") else None
        self.capacity = capacity or {"value": max_num_seqs, "source": "caller"}
        self._chunk = 0  # prompt tokens per prefilling row in the current step
        self._budget = prefill_budget or 0  # this step's budget (_step_budget)
        self.idle_budget_factor = idle_budget_factor
        self.pace = pace or PrefillPace()
        self.max_queue = max_queue
        self.policy = policy
        self.preprocessor = preprocessor
        self._intake: dict[str, _Intake] = {}
        self._seqs: dict[str, Sequence] = {}
        self._by_uid: dict[int, Sequence] = {}
        self._waiting = fair if fair is not None else FairQueue()
        self._arrivals = itertools.count()
        self.generated_tokens = 0  # lifetime counter, for tokens/s in stats
        self.prefilled_tokens = 0  # prompt tokens computed (not served by the prefix cache)
        self.choices = ChoiceGroups()
        self._scoring: deque[str] = deque()  # requests whose prompt logprobs are computed, in order
        self.finished = 0

    # -- intake ---------------------------------------------------------------------------
    def submit(self, req: p.GenerateRequest) -> list[Event]:
        try:
            self._check_choices(req)
        except ServiceError as e:
            return [(req.rid, p.error_event(e))]
        if req.n > 1:
            if req.rid in self.choices.groups:
                return [(req.rid, p.error_event(invalid(f"duplicate request id {req.rid}")))]
            events: list[Event] = []
            for choice in self.choices.expand(req):
                events += self._submit_one(choice)
            return self._merged(events)
        return self._submit_one(req)

    def _check_choices(self, req: p.GenerateRequest) -> None:
        if not isinstance(req.n, int) or not 1 <= req.n <= MAX_CHOICES:
            raise invalid(f"'n' must be between 1 and {MAX_CHOICES}", "n")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise invalid("'top_logprobs' must be between 0 and 20", "top_logprobs")
        if (req.n > 1 or req.logprobs is not None) and not self.runner.supports_choices:
            param = "n" if req.n > 1 else "logprobs"
            raise invalid(f"this model's engine does not support '{param}'", param)
        if req.prompt_logprobs is not None:
            if not isinstance(req.prompt_logprobs, int) or not 0 <= req.prompt_logprobs <= 20:
                raise invalid("'logprobs' must be between 0 and 20", "logprobs")
            if not getattr(self.runner, "supports_prompt_logprobs", False):
                raise invalid("this model's engine does not support prompt logprobs (echo with logprobs)", "echo")

    def _merged(self, events: list[Event]) -> list[Event]:
        """Events of requests with choices merged into one stream each (worker/choices.py)."""
        if not self.choices.members:
            return events
        out, cancel = self.choices.merge(events)
        for rid in cancel:
            out += self._merged(self._cancel_one(rid))
        return out

    def _submit_one(self, req: p.GenerateRequest) -> list[Event]:
        try:
            if req.rid in self._seqs or req.rid in self._intake:
                raise invalid(f"duplicate request id {req.rid}")
            # Requests that free running slots will take at the next step are not waiting.
            free_slots = max(0, self.max_num_seqs - len(self._by_uid))
            if self.waiting >= self.max_queue + free_slots:
                raise ServiceError(
                    ErrorCode.OVERLOADED,
                    f"model is at capacity ({self.waiting} requests waiting); retry shortly",
                    retry_after=1.0,
                )
            req = check_generate(req, getattr(self.runner, "vocab_size", None))
        except ServiceError as e:
            return [(req.rid, p.error_event(e))]
        intake = _Intake(req, next(self._arrivals), time.monotonic())
        self._intake[req.rid] = intake
        if self.preprocessor is None:
            return self._on_prepared(intake, *self._prepare_safely(req))
        self.preprocessor.submit(req.rid, lambda: self._prepare(req))
        return []

    def _prepare_safely(self, req: p.GenerateRequest) -> tuple[Prepared | None, BaseException | None]:
        try:
            return self._prepare(req), None
        except Exception as e:
            return None, e

    def _prepare(self, req: p.GenerateRequest) -> Prepared:
        """Template, tokenize and build the sequence's helpers (runs off the engine thread)."""
        try:
            prompt = self.runner.encode(req)
        except ServiceError:
            raise
        except Exception as e:  # the tokenizer refused this input (odd code points, ...): its sender's fault
            param = "messages" if req.messages is not None else "prompt"
            raise invalid(f"the prompt could not be tokenized: {type(e).__name__}: {e}", param) from None
        if not prompt:
            raise invalid("the prompt is empty", "prompt")
        max_tokens = check_budget(
            len(prompt), req.max_tokens, self.runner.context_length, req.max_tokens_policy or self.policy
        )
        constraint = self.runner.make_constraint(req)
        parser = self.runner.make_parser(req, prompt)
        if req.reasoning_budget is not None and parser is not None and parser.think:
            budget = ThinkingBudget(parser, req.reasoning_budget, self.runner.encode_text(parser.think[1]))
            constraint = [budget] + ([constraint] if constraint else [])
        return Prepared(prompt, max_tokens, parser, constraint)

    def _collect_prepared(self) -> list[Event]:
        if self.preprocessor is None:
            return []
        events = []
        for rid, prepared, error in self.preprocessor.ready():
            intake = self._intake.get(rid)
            if intake is not None:
                events += self._on_prepared(intake, prepared, error)
        return events

    def _on_prepared(self, intake: _Intake, prepared: Prepared | None, error: BaseException | None) -> list[Event]:
        req = intake.req
        del self._intake[req.rid]
        if error is not None or prepared is None:
            if not isinstance(error, ServiceError):
                log.error("preparing %s failed: %r", req.rid, error, exc_info=error)
            return [(req.rid, p.error_event(as_service_error(error, "preparing its prompt")))]
        from .textstream import TextStream

        try:
            text = TextStream(self.runner.new_detokenizer(), req.stop)
        except Exception as e:
            return [(req.rid, p.error_event(as_service_error(e, "starting its detokenizer")))]
        seq = Sequence(
            req=req,
            prompt=prepared.prompt,
            max_tokens=prepared.max_tokens,
            arrived=intake.arrived,
            deadline=_first_deadline(req, intake.arrived),
            text=text,
            guard=SequenceGuard(req.rid),
            parser=prepared.parser,
            constraint=prepared.constraint,
        )
        if req.prompt_logprobs is not None:
            try:
                seq.scorer = self.runner.prompt_scorer(seq.prompt, req.prompt_logprobs)  # type: ignore[attr-defined]
            except Exception as e:
                return [(req.rid, p.error_event(as_service_error(e, "scoring its prompt")))]
            seq.phase = "scoring"
            self._scoring.append(req.rid)
        self._seqs[req.rid] = seq
        seq.arrival = intake.arrival
        self._queue(seq)
        accepted = p.Accepted(prompt_tokens=len(seq.prompt), max_tokens=seq.max_tokens, queued=self.waiting)
        return [(req.rid, accepted.to_wire())]

    def cancel(self, rid: str) -> list[Event]:
        choices = self.choices.internal_rids(rid)
        if choices:
            return self._merged([ev for choice in choices for ev in self._cancel_one(choice)])
        return self._cancel_one(rid)

    def _cancel_one(self, rid: str) -> list[Event]:
        if rid in self._intake:
            del self._intake[rid]
            if self.preprocessor is not None:
                self.preprocessor.discard(rid)
            self.finished += 1
            return [(rid, p.Finish("cancelled", p.Usage(), text="").to_wire())]
        seq = self._seqs.get(rid)
        if seq is None:
            return []
        return [self._end(seq, p.Finish("cancelled", seq.usage(), text="").to_wire())]

    # -- the step loop ---------------------------------------------------------------------
    def has_work(self) -> bool:
        """Sequences to step (requests still being prepared wait on their own thread)."""
        return bool(self._seqs)

    def preparing(self) -> int:
        return len(self._intake)

    def step(self) -> list[Event]:
        return self._merged(self._step())

    def _step(self) -> list[Event]:
        events = self._collect_prepared()
        events += self._expire(time.monotonic())
        events += self._score()
        events += self._admit()
        if not self._by_uid:
            return events
        self._set_chunk()
        reading = self._tokens_read_this_step()
        started = time.monotonic()
        out = self.runner.step()
        self.pace.observe(reading, time.monotonic() - started)
        self._count_prefill()
        events += self._end_faulted()
        return events + self._on_step_tokens(out)

    def _on_step_tokens(self, out) -> list[Event]:
        events: list[Event] = []
        for uid, done, total in out.prefill:
            seq = self._by_uid.get(uid)
            if seq is not None and done < total and not seq.tokens:  # a resumed row's client saw its prompt done
                seq.phase = "prefill"
                seq.prefilled = done
                events.append((seq.req.rid, p.Progress(done, total, seq.cached_tokens or None).to_wire()))
        for t in out.tokens:
            seq = self._by_uid.get(t.uid)
            if seq is None:
                continue
            try:
                events.extend(self._on_token(seq, t.token, t.finish, t.logprobs))
            except Exception as e:  # detokenizer, stop strings, output parser: this sequence's fault
                log.error("request %s failed on a token: %r", seq.req.rid, e, exc_info=e)
                if seq.req.rid in self._seqs:
                    err = as_service_error(e, "decoding its output")
                    events.append(self._end(seq, p.error_event(err, seq.usage())))
        return events

    def poll_prepared(self) -> list[Event]:
        """Accepted (or refused) requests whose preparation finished: for an idle engine."""
        return self._merged(self._collect_prepared())

    def _end_faulted(self) -> list[Event]:
        """Sequences whose sampler or logits processors raised during the step."""
        events = []
        for seq in [s for s in self._by_uid.values() if s.guard.faulted]:
            err = as_service_error(seq.guard.error, "sampling")  # type: ignore[arg-type]
            events.append(self._end(seq, p.error_event(err, seq.usage())))
        return events

    def _admit(self) -> list[Event]:
        """Start waiting sequences while there is room. A sequence the runner refuses at
        admission (a vision model's images its vision tower cannot take, or any exception)
        ends with an error; the runner has not taken it, so the others are unaffected."""
        events: list[Event] = []
        deferred: list[Waiting] = []
        self._budget = self._step_budget()
        events += self._preempt_for_starved()
        while self._waiting and len(self._by_uid) < self.max_num_seqs:
            entry = self._waiting.pop(self._rows())
            if entry is None:
                break
            rid = entry.rid
            seq = self._seqs.get(rid)
            if seq is None or seq.uid is not None:
                continue  # cancelled while queued
            if seq.scorer is not None:
                deferred.append(entry)  # its prompt logprobs come first (_score)
                continue
            leader = self._seqs.get(self.choices.is_follower(rid) or "")
            if leader is not None and leader.phase != "decode":
                deferred.append(entry)  # choice 0's prompt KV is not in the prefix cache yet
                continue
            if not self._prefill_fits(seq):
                deferred.append(entry)  # this step's prompt budget is taken: next step
                break
            try:
                self._insert(seq)
            except Exception as e:
                if not isinstance(e, ServiceError):
                    log.error("admitting %s failed: %r", rid, e, exc_info=e)
                events.append(self._end(seq, p.error_event(as_service_error(e, "admitting it"))))
                continue
            seq.phase = "prefill" if not seq.tokens else "decode"
            self._by_uid[seq.uid] = seq
        for entry in deferred:
            self._waiting.push(entry)
        return events

    def _insert(self, seq: Sequence) -> None:
        """Into the runner; a resumed row continues from its prompt + generated tokens (their
        KV is in the prefix cache since its pause), for the tokens it has left."""
        # A fresh row passes its prompt object itself: a vision prompt carries its pixels on it.
        prompt = seq.prompt + seq.tokens if seq.tokens else seq.prompt
        uid, cached = self.runner.insert(
            prompt,
            seq.max_tokens - seq.generated,
            seq.req.sampling,
            seq.constraint,
            guard=seq.guard,
            **self._extra(seq),
        )
        seq.uid = uid
        if not seq.tokens:
            seq.cached_tokens = cached  # usage reports the first admission's cache hit
        self.prefilled_tokens += len(prompt) - cached
        seq.to_prefill = max(0, len(prompt) - cached - 1)

    def _queue(self, seq: Sequence) -> None:
        req = seq.req
        tenant = req.tenant if isinstance(req.tenant, str) else ""
        self._waiting.push(
            Waiting(req.priority, seq.arrival, req.rid, tenant, clean_weight(req.weight), time.monotonic())
        )

    def _rows(self) -> list[Row]:
        return [
            Row(
                s.req.rid,
                s.req.tenant or "",
                clean_weight(s.req.weight),
                s.req.priority,
                s.generated,
                self._pausable(s),
            )
            for s in self._by_uid.values()
        ]

    def _pausable(self, seq: Sequence) -> bool:
        rid = seq.req.rid  # choices share one prompt's KV: none of them is paused
        return seq.preemptible() and not self.choices.is_leader(rid) and not self.choices.is_follower(rid)

    def _preempt_for_starved(self) -> list[Event]:
        """Pause one running row when the request next in line has waited beyond the bound
        and a row is held beyond its tenant's share (worker/fair_share.py). The paused row's
        KV goes to the prefix cache (runner.remove) and it re-queues at its old place; the
        output it has sent stays sent, and it resumes with the next token."""
        if len(self._by_uid) < self.max_num_seqs or not self._waiting:
            return []
        rid = self._waiting.victim(self._rows(), time.monotonic())
        seq = self._seqs.get(rid or "")
        if seq is None or seq.uid is None:
            return []
        uid = seq.uid
        try:
            self.runner.remove([uid])
        except Exception as e:  # the runner no longer holds it: end it rather than resume blind
            log.warning("pausing %s failed: %r", seq.req.rid, e)
            return [self._end(seq, p.error_event(as_service_error(e, "pausing it")), remove=False)]
        del self._by_uid[uid]
        seq.uid, seq.paused, seq.phase, seq.to_prefill = None, seq.paused + 1, "queued", 0
        self._queue(seq)
        log.info("paused %s (tenant share) after %d tokens", seq.req.rid, seq.generated)
        return []

    def _score(self) -> list[Event]:
        """One chunk of prompt scoring per step, for the oldest request that asked for prompt
        logprobs (worker/prompt_logprobs.py): the rows decoding meanwhile wait at most one
        chunk. A request is admitted once its prompt is scored, after its PromptLogprobs event."""
        while self._scoring:
            seq = self._seqs.get(self._scoring[0])
            if seq is None or seq.scorer is None:  # cancelled or timed out meanwhile
                self._scoring.popleft()
                continue
            try:
                if not seq.scorer.advance():  # type: ignore[attr-defined]
                    return []
            except Exception as e:
                self._scoring.popleft()
                log.error("scoring the prompt of %s failed: %r", seq.req.rid, e, exc_info=e)
                return [self._end(seq, p.error_event(as_service_error(e, "scoring its prompt")))]
            self._scoring.popleft()
            entries, seq.scorer = seq.scorer.entries, None  # type: ignore[attr-defined]
            seq.phase = "queued"
            return [(seq.req.rid, p.PromptLogprobs(entries).to_wire())]
        return []

    def _prefilling(self) -> list[Sequence]:
        return [s for s in self._by_uid.values() if s.to_prefill > 0]

    def _prefill_fits(self, seq: Sequence) -> bool:
        """Whether seq may start this step under the prompt budget. Its cached prefix is not
        known before the runner looks it up, so the whole prompt counts (a cache hit then
        leaves room for more)."""
        if self.prefill_budget is None:
            return True
        prefilling = [s.to_prefill for s in self._prefilling()]
        return admit_count(prefilling, [len(seq.prompt) - 1], self._budget) == 1

    def _step_budget(self) -> int:
        """The budget protects rows that are decoding; with none (a burst arriving at an idle
        model), the prompts only wait for each other, and one larger step starts them all
        sooner than several small ones would."""
        budget = self.prefill_budget or 0
        decoding = any(s.to_prefill == 0 for s in self._by_uid.values())
        return self.pace.cap(budget if decoding else budget * self.idle_budget_factor, decoding)

    def _tokens_read_this_step(self) -> int:
        if self.prefill_budget is None:
            return 0
        return sum(min(s.to_prefill, self._chunk) for s in self._prefilling())

    def _set_chunk(self) -> None:
        """Share this step's prompt budget among the rows still reading their prompts."""
        if self.prefill_budget is None:
            return
        self._chunk = chunk_for(len(self._prefilling()), self._budget)
        self.runner.set_prefill_chunk(self._chunk)  # type: ignore[attr-defined]

    def _count_prefill(self) -> None:
        """The runner read min(left, chunk) prompt tokens of every prefilling row."""
        if self.prefill_budget is None:
            return
        for seq in self._prefilling():
            seq.to_prefill -= min(seq.to_prefill, self._chunk)

    def _extra(self, seq: Sequence) -> dict:
        """Options only runners with supports_choices take (checked at submit)."""
        extra: dict = {}
        if seq.req.logprobs is not None:
            extra["logprobs"] = seq.req.logprobs
        if self.choices.is_leader(seq.req.rid):
            extra["keep_prompt"] = True
        return extra

    def _on_token(self, seq: Sequence, token: int, finish: str | None, logprobs: dict | None = None) -> list[Event]:
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            seq.phase = "decode"
            # The prefill bound is over; the generation gets its own, from now.
            seq.deadline = seq.first_token_at + seq.req.timeout_s if seq.req.timeout_s else None
        if finish == "stop":  # end-of-sequence token: not part of the answer
            text = seq.text.finish()
        else:
            seq.generated += 1
            seq.tokens.append(token)
            self.generated_tokens += 1
            if logprobs is not None:  # the end-of-sequence token above is not part of the answer
                seq.unsent_logprobs.append(logprobs)
            text = seq.text.push(token)
            if seq.text.stopped:
                finish = "stop"
                self.runner.remove([seq.uid])
            elif finish == "length":
                text += seq.text.finish()
        parser = seq.parser
        if text:
            seq.unsent.extend(parser.feed(text) if parser else Parsed(text=text))
        seq.unsent_tokens += 1
        if finish is not None:
            if parser:
                seq.unsent.extend(parser.finish())
                if parser.saw_tool_calls and finish == "stop":
                    finish = "tool_calls"
            end = p.Finish(
                finish, seq.usage(), stop=seq.text.stop_match, logprobs=self._take_logprobs(seq), **_parts(seq.unsent)
            )
            return [self._end(seq, end.to_wire(), remove=False)]
        if seq.unsent_tokens >= max(1, seq.req.stream_interval) and seq.unsent:
            cached = None if seq.sent_delta else seq.cached_tokens or None
            delta = p.Delta(n=seq.generated, logprobs=self._take_logprobs(seq), cached=cached, **_parts(seq.unsent))
            seq.sent_delta = True
            seq.unsent = Parsed()
            seq.unsent_tokens = 0
            return [(seq.req.rid, delta.to_wire())]
        return []

    @staticmethod
    def _take_logprobs(seq: Sequence) -> list[dict] | None:
        if seq.req.logprobs is None:
            return None
        taken, seq.unsent_logprobs = seq.unsent_logprobs, []
        return taken

    def _expire(self, now: float) -> list[Event]:
        events = []
        for seq in [s for s in self._seqs.values() if s.deadline and now >= s.deadline]:
            if seq.generated > 0:  # a time limit ends the answer, not the request
                events.append(self._finish_at_time_limit(seq))
                continue
            if seq.first_token_at is None:
                bound = prefill_bound(len(seq.prompt), _prefill_bound(seq.req), self.pace.tokens_per_s)
                if now < seq.arrived + bound:
                    continue  # a long prompt on this host: its bound scales with it
                why = f"no first token within {bound:g} s (queue and prompt processing)"
            else:
                why = f"the answer took over {seq.req.timeout_s:g} s ({seq.generated} tokens generated)"
            err = ServiceError(ErrorCode.TIMEOUT, f"request timed out: {why}")
            events.append(self._end(seq, p.error_event(err, seq.usage())))
        return events

    def _finish_at_time_limit(self, seq: Sequence) -> Event:
        """The answer's time bound ran out after tokens were generated: they are the answer,
        finished with reason length (the client's usual "cut short"), marked time_limited."""
        text = seq.text.finish()
        parser = seq.parser
        if text:
            seq.unsent.extend(parser.feed(text) if parser else Parsed(text=text))
        if parser:
            seq.unsent.extend(parser.finish())
        log.info(
            "%s: answer time limit of %g s reached after %d tokens; finished with them",
            seq.req.rid,
            seq.req.timeout_s,
            seq.generated,
        )
        end = p.Finish(
            "length", seq.usage(), logprobs=self._take_logprobs(seq), time_limited=True, **_parts(seq.unsent)
        )
        return self._end(seq, end.to_wire())

    def _end(self, seq: Sequence, event: dict, remove: bool = True) -> Event:
        self._seqs.pop(seq.req.rid, None)
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
            if remove:
                try:
                    self.runner.remove([seq.uid])
                except Exception as e:  # already gone from the runner: nothing left to free
                    log.warning("removing %s from the runner failed: %r", seq.req.rid, e)
            if not self._by_uid and hasattr(self.runner, "release_idle_memory"):
                self.runner.release_idle_memory()  # the last running sequence ended
        self.finished += 1
        return (seq.req.rid, event)

    # -- introspection ---------------------------------------------------------------------
    def counters(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_num_seqs_basis": self.capacity,
            "prefill_budget": self.prefill_budget,
            "prefill_step_budget": self._budget if self.prefill_budget is not None else None,
            "prefill_tokens_per_s": round(self.pace.tokens_per_s, 1) if self.pace.tokens_per_s else None,
            "fair_share": self._waiting.enabled,
            "preemptions": self._waiting.preemptions,
        }

    @property
    def running(self) -> int:
        return len(self._by_uid)

    @property
    def waiting(self) -> int:
        return len(self._seqs) - len(self._by_uid) + len(self._intake)

    def requests(self) -> list[dict]:
        now = time.monotonic()
        preparing = [
            {
                "id": rid,
                "phase": "preparing",
                "prompt_tokens": 0,
                "cached_tokens": 0,
                "generated_tokens": 0,
                "age_s": round(now - i.arrived, 3),
                "ttft_s": None,
            }
            for rid, i in self._intake.items()
        ]
        return preparing + [
            {
                "id": s.req.rid,
                "phase": s.phase,
                "prompt_tokens": len(s.prompt),
                "cached_tokens": s.cached_tokens,
                "generated_tokens": s.generated,
                # long prompts: how far the prefill has got (cached tokens count as done)
                "prefilled_tokens": len(s.prompt) if s.first_token_at else s.cached_tokens + s.prefilled,
                "age_s": round(now - s.arrived, 3),
                "ttft_s": round(s.first_token_at - s.arrived, 3) if s.first_token_at else None,
            }
            for s in self._seqs.values()
        ]


def _prefill_bound(req: p.GenerateRequest) -> float | None:
    return req.prefill_timeout_s or req.timeout_s


def _first_deadline(req: p.GenerateRequest, arrived: float) -> float | None:
    """Until its first token a sequence is bounded by the queue + prefill timeout."""
    bound = _prefill_bound(req)
    return arrived + bound if bound else None
