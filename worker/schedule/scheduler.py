"""A generating worker's requests through their lifecycle (the runner executes).

- a request is checked against the model (worker/schedule/request_checks.py), then prepared (chat
  template, tokenizing, constraint) off the engine thread (intake.py; PrefillPace.prepare_wait_s);
- bounded waiting queue (`max_queue`): past it a request is refused as overloaded;
- a request that cannot fit the KV budget even alone is refused (or its max_tokens cut) when
  prepared; the rest are admitted within it by what they hold, and rows that outgrow it are
  paused to the prefix store (worker/model/memory/kv_budget.py, worker/schedule/kv_rows.py);
- admission.py admits at most `max_num_seqs` rows at step boundaries by priority, deadline
  (latency.py's classes) and fair share, with preemption; prefill_plan.py bounds each step's
  prompt reading to a few decode steps' time while rows decode (IDLE_BUDGET_FACTOR when none);
- each step's tokens become Delta / Finish events (worker/schedule/sequence_output.py);
- a request ends exactly once: finish (stop / length / cancelled) or error (timeout, ...);
  cancelled and timed-out sequences leave the runner, and so free their KV, at once;
- a fault of one sequence (an exception while preparing, admitting, sampling, constraining
  or detokenizing it) ends that sequence with an error and leaves the batch running.
A request's state and phases are worker/schedule/sequence.py's.
"""

from __future__ import annotations

import logging
import time

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.events import Accepted, AnyEvent, Error, Finish, FinishReason, Usage
from ..model.interfaces import StepOutput, TextRunner
from ..model.memory.kv_budget import KVBudget
from ..model.runners.isolation import as_service_error
from .admission import Admission
from .choices import ChoiceGroups
from .fair_share import FairQueue
from .intake import Preparing, Ready
from .latency import ClassStats
from .prefill_plan import IDLE_BUDGET_FACTOR, PrefillBudget, PrefillPace
from .preprocess import Preprocessor
from .request_checks import check_choices, check_generate
from .sequence import Phase, Sequence
from .sequence_output import PromptScoring, on_deadline, on_progress, on_token

log = logging.getLogger(__name__)

Event = p.Event


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
        kv: KVBudget | None = None,
    ):
        """preprocessor: prepares requests on its own thread; None prepares them in submit
        (in-process tests and benchmarks). prefill_budget: prompt tokens per step across
        the prefilling rows (None: every admitted prompt reads the runner's own chunk per
        step); used only with runners that take a chunk size (supports_prefill_chunk).
        capacity: how max_num_seqs was chosen (worker/model/memory/capacity.py), for stats.
        pace: how fast this host reads prompts, which caps a step's budget so that no step
        runs long enough to look hung (worker/schedule/prefill_plan.py).
        fair: the waiting queue and its policy (worker/schedule/fair_share.py; tests set its bound).
        kv: the KV budget rows are admitted within (worker/model/memory/kv_budget.py); None: by count."""
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        per_step = prefill_budget if runner.supports_prefill_chunk else None
        self.prefill = PrefillBudget(per_step, pace or PrefillPace(), idle_budget_factor, prefill_budget or 0)
        self.capacity = capacity or {"value": max_num_seqs, "source": "caller"}
        self.max_queue = max_queue
        self.choices = ChoiceGroups()
        if kv is not None:  # a window layer holds the chunk a step reads past its window
            kv.set_chunk((prefill_budget or 0) * idle_budget_factor)
        self.admission = Admission(
            runner, max_num_seqs, self.prefill, fair if fair is not None else FairQueue(), self.choices, kv
        )
        self._preparing = Preparing(runner, policy, preprocessor, kv)
        self._seqs: dict[str, Sequence] = {}  # every live sequence (queued or running), by request id
        self.generated_tokens = 0  # lifetime counter, for tokens/s in stats
        self._scoring = PromptScoring()
        self.classes = ClassStats()  # first-token times per latency class, for /v1/status
        self.finished = 0

    # -- intake ---------------------------------------------------------------------------
    def submit(self, req: p.GenerateRequest) -> list[Event]:
        try:
            check_choices(req, self.runner.supports_choices, self.runner.supports_prompt_logprobs)
        except ServiceError as e:
            return [(req.rid, Error(e))]
        if req.n > 1:
            if req.rid in self.choices.groups:
                return [(req.rid, Error(invalid(f"duplicate request id {req.rid}")))]
            events: list[Event] = []
            for choice in self.choices.expand(req):
                events += self._submit_one(choice)
            return self._merged(events)
        return self._submit_one(req)

    def _merged(self, events: list[Event]) -> list[Event]:
        """Events of requests with choices merged into one stream each (worker/schedule/choices.py)."""
        if not self.choices.members:
            return events
        out, cancel = self.choices.merge(events)
        for rid in cancel:
            out += self._merged(self._cancel_one(rid))
        return out

    def _submit_one(self, req: p.GenerateRequest) -> list[Event]:
        try:
            if req.rid in self._seqs or req.rid in self._preparing:
                raise invalid(f"duplicate request id {req.rid}")
            # Requests that free running slots will take at the next step are not waiting.
            free_slots = max(0, self.max_num_seqs - len(self.admission.running))
            if self.waiting >= self.max_queue + free_slots:
                raise ServiceError(
                    ErrorCode.OVERLOADED,
                    f"model is at capacity ({self.waiting} requests waiting); retry shortly",
                    retry_after=1.0,
                )
            req = check_generate(req, self.runner.vocab_size)
        except ServiceError as e:
            return [(req.rid, Error(e))]
        return self._queue_prepared(self._preparing.add(req))

    def _queue_prepared(self, ready: list[Ready]) -> list[Event]:
        """Prepared requests join the waiting queue (Accepted), or end (an error event)."""
        events: list[Event] = []
        for done in ready:
            seq, rid = self._preparing.start(done), done[0].req.rid
            if not isinstance(seq, Sequence):
                events.append((rid, seq))
                continue
            if seq.scorer is not None:
                self._scoring.add(seq)
            self._seqs[rid] = seq
            self.admission.queue(seq)
            accepted = Accepted(prompt_tokens=len(seq.prompt), max_tokens=seq.max_tokens, queued=self.waiting)
            events.append((rid, accepted))
        return events

    def cancel(self, rid: str) -> list[Event]:
        choices = self.choices.internal_rids(rid)
        if choices:
            return self._merged([ev for choice in choices for ev in self._cancel_one(choice)])
        return self._cancel_one(rid)

    def _cancel_one(self, rid: str) -> list[Event]:
        if self._preparing.cancel(rid):
            self.finished += 1
            return [(rid, Finish(FinishReason.CANCELLED, Usage(), text=""))]
        seq = self._seqs.get(rid)
        if seq is None:
            return []
        return [self._end(seq, Finish(FinishReason.CANCELLED, seq.usage(), text=""))]

    # -- the step loop ---------------------------------------------------------------------
    def has_work(self) -> bool:
        """Sequences to step (requests still being prepared wait on their own thread)."""
        return bool(self._seqs)

    def preparing(self) -> int:
        return len(self._preparing)

    def poll_prepared(self) -> list[Event]:
        """Accepted (or refused) requests whose preparation finished: for an idle engine."""
        return self._merged(self._queue_prepared(self._preparing.ready()))

    def step(self) -> list[Event]:
        return self._merged(self._step())

    def _step(self) -> list[Event]:
        events = self._queue_prepared(self._preparing.ready(self.prefill.pace.prepare_wait_s()))
        events += self._expire(time.monotonic())
        events += self._score()
        events += self._admit()
        if not self.admission.running:
            return events
        reading = self.prefill.share(self.admission.running.values(), self.runner)
        started = time.monotonic()
        out = self.runner.step()
        self.prefill.observe(reading, time.monotonic() - started, out.prompt_s)
        self.prefill.count(self.admission.running.values())
        self.admission.traced.step()  # the steps of traced rows (worker/schedule/trace_marks.py)
        events += self._end_faulted()
        return events + self._on_step_tokens(out)

    def _on_step_tokens(self, out: StepOutput) -> list[Event]:
        events: list[Event] = []
        for uid, done, total in out.prefill:
            seq = self.admission.running.get(uid)
            progress = on_progress(seq, done, total) if seq is not None else None
            if progress is not None:
                events.append((seq.req.rid, progress))
        for t in out.tokens:
            seq = self.admission.running.get(t.uid)
            if seq is None:
                continue
            try:
                events.extend(self._on_token(seq, t.token, t.finish, t.logprobs))
            except Exception as e:  # detokenizer, stop strings, output parser: this sequence's fault
                log.error("request %s failed on a token: %r", seq.req.rid, e, exc_info=e)
                if seq.req.rid in self._seqs:
                    err = as_service_error(e, "decoding its output")
                    events.append(self._end(seq, Error(err, seq.usage())))
        return events

    def _on_token(self, seq: Sequence, token: int, finish: str | None, logprobs: dict | None) -> list[Event]:
        counted, first = seq.generated, seq.first_token_at is None
        event, ended = on_token(seq, token, finish, logprobs)
        if first:
            self.classes.first_token(seq)
        self.generated_tokens += seq.generated - counted
        if ended and finish != FinishReason.STOP and seq.text.stopped:
            self.runner.remove([seq.uid])  # a stop string ended it: the runner's row still runs
        if event is None:
            return []
        return [self._end(seq, event, remove=False)] if ended else [(seq.req.rid, event)]

    def _end_faulted(self) -> list[Event]:
        """Sequences whose sampler or logits processors raised during the step."""
        events = []
        for seq in [s for s in self.admission.running.values() if s.guard.error is not None]:
            err = as_service_error(seq.guard.error, "sampling")
            events.append(self._end(seq, Error(err, seq.usage())))
        return events

    def _admit(self) -> list[Event]:
        return [self._end(seq, event, remove=False) for seq, event in self.admission.admit(self._seqs)]

    def _score(self) -> list[Event]:
        """One chunk of prompt scoring per step (sequence_output.PromptScoring). A request is
        admitted once its prompt is scored, after its PromptLogprobs event."""
        scored = self._scoring.advance(self._seqs)
        if scored is None:
            return []
        seq, event, error = scored
        if error is not None:
            log.error("scoring the prompt of %s failed: %r", seq.req.rid, error, exc_info=error)
            return [self._end(seq, Error(as_service_error(error, "scoring its prompt")))]
        return [(seq.req.rid, event)]

    def _expire(self, now: float) -> list[Event]:
        events = []
        for seq in [s for s in self._seqs.values() if s.deadline and now >= s.deadline]:
            event = on_deadline(seq, now, self.prefill.pace.tokens_per_s)
            if event is not None:
                events.append(self._end(seq, event))
        return events

    def _end(self, seq: Sequence, event: AnyEvent, remove: bool = True) -> Event:
        seq.phase = Phase.DONE
        if seq.marks is not None:  # traced: its times go back with its last event
            event.trace = seq.marks.wire(seq.first_token_at)
        self._seqs.pop(seq.req.rid, None)
        if seq.uid is not None:
            self.admission.release(seq)
            if remove:
                try:
                    self.runner.remove([seq.uid])
                except Exception as e:  # already gone from the runner: nothing left to free
                    log.warning("removing %s from the runner failed: %r", seq.req.rid, e)
            if not self.admission.running:
                self.runner.release_idle_memory()  # the last running sequence ended
        self.finished += 1
        return (seq.req.rid, event)

    # -- introspection ---------------------------------------------------------------------
    def counters(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            **self.admission.counters(),
            "max_num_seqs_basis": self.capacity,
            "classes": self.classes.report(self._seqs.values()),
        }

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens computed, lifetime (those the prefix cache served are not)."""
        return self.admission.prefilled_tokens

    @property
    def running(self) -> int:
        return len(self.admission.running)

    @property
    def waiting(self) -> int:
        return len(self._seqs) - len(self.admission.running) + len(self._preparing)

    def requests(self) -> list[dict]:
        now = time.monotonic()
        return self._preparing.listing(now) + [s.listing(now) for s in self._seqs.values()]
