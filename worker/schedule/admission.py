"""Who runs next: the waiting queue, the rows the runner holds, and admission at a step.

- at most `max_num_seqs` sequences run; new ones are admitted at step boundaries, by
  priority class, then fair share between tenants (API keys), then deadline (arrival + its
  latency class's target: worker/schedule/latency.py) (worker/schedule/fair_share.py);
- a request starved beyond a bound preempts a row held beyond its tenant's share: the row is
  paused with its KV in the prefix cache (runner.remove) and re-queued at its old place; the
  output it has sent stays sent, and it resumes with the next token;
- each step reads at most a budget of prompt tokens across the rows still prefilling, and
  admits new prompts only while that budget is shared fairly between rows
  (worker/schedule/prefill_plan.py) and between tenants (FairQueue.may_start_prefill);
- a prompt whose cached prefix lies in the disk tier waits while its blocks are read off
  the engine thread (read from when it is queued: runner.prefix_ready), so the running rows
  keep stepping instead of waiting for the disk;
- a request with prompt logprobs waits until they are computed; sibling choices (n > 1) wait
  until choice 0 decodes (its prompt KV is then in the prefix cache);
- with a KV budget (worker/model/memory/kv_budget.py), a row is admitted only while what the rows hold,
  and a decode allowance each, fits it (worker/schedule/kv_rows.py: a row that cannot be paused
  counts its whole reach); the prefix cache gives way (cut, before every step, to what the
  rows hold, once a new row has looked up its prefix), and a row that does not fit waits at
  the head of the queue (those behind it wait too, so a long prompt is not starved by short
  ones) until rows end or are paused;
- before each step, while the rows' KV after it would not fit the budget, the latest
  arrival of the least urgent class is paused to the prefix store (never the only row) and
  re-queued at its old place, by the same pause as fair share's.
Admission never ends a request itself: what the runner refuses comes back to the scheduler
as (sequence, error event), and the other rows are unaffected."""

from __future__ import annotations

import logging
import time

from ...shared.errors import ServiceError
from ...shared.events import Error
from ..model import interfaces
from ..model.interfaces import TextRunner
from ..model.memory.kv_budget import KVBudget
from ..model.runners.isolation import as_service_error
from .choices import ChoiceGroups
from .fair_share import FairQueue, Row, Waiting, clean_weight
from .kv_rows import after_step, reserve, victim
from .latency import EDITOR_HOLD_S, class_of
from .prefill_plan import DECODE_STEPS_PER_PREFILL, EDITOR_RECENT_S, TYPING_DECODE_STEPS, TYPING_S, PrefillBudget
from .prefix_inflight import SharedPrefill
from .sequence import Phase, Sequence
from .trace_marks import TracedRows

log = logging.getLogger(__name__)

DISK_WAIT_S = 0.002
Refused = tuple[Sequence, Error]  # a sequence to end, with its error event


class Admission:
    def __init__(
        self,
        runner: TextRunner,
        max_num_seqs: int,
        prefill: PrefillBudget,
        fair: FairQueue,
        choices: ChoiceGroups,
        kv: KVBudget | None = None,
    ):
        """kv: the KV budget rows are admitted within (None: by count alone)."""
        self.runner = runner
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.prefill = prefill
        self.waiting = fair
        self.choices = choices
        self.running: dict[int, Sequence] = {}  # the runner's rows, by uid
        self.traced = TracedRows()  # those of them the gateway traces
        self.prefilled_tokens = 0  # prompt tokens computed (not served by the prefix cache)
        # One prefill per prefix in flight (worker/schedule/prefix_inflight.py), where the runner can
        # publish a running row's prompt KV at its first token (not a lockstep group's).
        self.shared_prefill = SharedPrefill(runner) if runner.supports_shared_prefill else None
        self.keystroke_at = float("-inf")  # when an editor-class request last arrived

    def queue(self, seq: Sequence) -> None:
        req = seq.req
        tenant = req.tenant if isinstance(req.tenant, str) else ""
        if class_of(req) == "editor":
            self.keystroke_at = time.monotonic()
        target = seq.target_s  # its first token is owed by arrival + its class's target
        entry = Waiting(req.priority, seq.arrival, req.rid, tenant, clean_weight(req.weight), time.monotonic())
        entry.due, entry.target_s = seq.arrived + target, target
        prompt, namespace = _prompt_of(seq), seq.req.cache_namespace
        entry.left = len(prompt) - self.runner.cached_tokens(prompt, namespace)  # shortest reads first
        self.waiting.push(entry)
        # its disk blocks start loading while it queues
        self.runner.prefix_ready(prompt, namespace)

    def release(self, seq: Sequence) -> None:
        """seq no longer runs (ended, or its row was taken from the runner)."""
        if seq.uid is not None and self.running.pop(seq.uid, None) is not None:
            self._bound_prefix_cache()
        if seq.marks is not None:
            self.traced.remove(seq)
        if self.shared_prefill is not None:
            self.shared_prefill.release(seq)

    def _pausable(self, seq: Sequence) -> bool:
        """Whether seq's row can be paused and resumed exactly (choices share one prompt's KV)."""
        rid = seq.req.rid
        return seq.resumable() and not self.choices.is_leader(rid) and not self.choices.is_follower(rid)

    def reserved(self, extra: Sequence | None = None) -> int:
        """KV bytes admission counts for the running rows (and extra): worker/schedule/kv_rows.py."""
        if self.kv is None:
            return 0
        rows = list(self.running.values()) + ([extra] if extra is not None else [])
        return self.kv.bytes_for([reserve(s, self._pausable(s), self.kv.decode_allowance) for s in rows])

    def held(self) -> int:
        """KV bytes the running rows hold after the next step."""
        return self.kv.bytes_for([after_step(s) for s in self.running.values()]) if self.kv is not None else 0

    def _bound_prefix_cache(self) -> None:
        """The prefix cache may hold what the rows leave of the budget after the next step (the
        allowance they have not grown into yet too: it is cut again as they do)."""
        if self.kv is not None:
            self.runner.limit_prefix_cache(max(0, self.kv.budget_bytes - self.held()))

    def _fits(self, seq: Sequence) -> bool:
        """Whether seq's row fits the KV budget beside the running rows (the prefix cache is
        evictable: it gives way once the row is in, _insert); else it waits."""
        if self.kv is None:
            return True
        self.kv.waiting_for_memory = self.reserved(seq) > self.kv.budget_bytes
        return not self.kv.waiting_for_memory

    def _pace_steps(self) -> float:
        """How many decode steps a step's prompt reading may take (prefill_plan.py): one while
        a typist types (a keystroke in the last TYPING_S: the last of a burst is owed its first
        token within the pause, and waits for the step in progress, then its own); a few while
        an editor is about (an editor request running, or one in the last EDITOR_RECENT_S);
        else 0, not paced."""
        since = time.monotonic() - self.keystroke_at
        if since < TYPING_S:
            return TYPING_DECODE_STEPS
        if since < EDITOR_RECENT_S or any(class_of(s.req) == "editor" for s in self.running.values()):
            return DECODE_STEPS_PER_PREFILL
        return 0

    def admit(self, seqs: dict[str, Sequence]) -> list[Refused]:
        """Start waiting sequences (seqs: every live one, by request id) while there is room."""
        refused: list[Refused] = []
        deferred: list[Waiting] = []
        self.prefill.start_step(self.running.values(), self._pace_steps())
        if self.shared_prefill is not None:
            self.shared_prefill.start_step()
        refused += self._preempt_for_memory()
        refused += self._preempt_for_starved(seqs)
        reading = False  # a prompt waits for its prefix's blocks to be read from disk
        while self.waiting and len(self.running) < self.max_num_seqs:
            rows = self._rows()
            entry = self.waiting.pop(rows)
            if entry is None:
                break
            seq = seqs.get(entry.rid)
            if seq is None or seq.uid is not None:
                continue  # cancelled while queued
            if seq.scorer is not None:
                deferred.append(entry)  # its prompt logprobs come first
                continue
            leader = seqs.get(self.choices.is_follower(entry.rid) or "")
            if leader is not None and leader.phase != Phase.DECODE:
                deferred.append(entry)  # choice 0's prompt KV is not in the prefix cache yet
                continue
            if self.shared_prefill is not None and self.shared_prefill.waits(seq, self.running.values()):
                deferred.append(entry)  # another row reads its prefix now: reuse it once published
                continue
            if not self.runner.prefix_ready(_prompt_of(seq), seq.req.cache_namespace):
                deferred.append(entry)  # its prefix is being read from disk: the others go on
                reading = True
                continue
            if self.prefill.enabled and not seq.tokens and not self.waiting.may_start_prefill(entry, rows):
                deferred.append(entry)  # its key has its share of the prompt budget: another key's first
                continue
            prompt = _prompt_of(seq)
            left = len(prompt) - self.runner.cached_tokens(prompt, seq.req.cache_namespace)
            if not self.prefill.fits(self.running.values(), seq, left):
                deferred.append(entry)  # this step's prompt budget is taken: next step
                break
            if not self._fits(seq):
                deferred.append(entry)  # its KV does not fit beside the running rows: it waits
                break
            try:
                self._insert(seq)
            except Exception as e:  # a vision model's images its tower cannot take, or any fault
                if not isinstance(e, ServiceError):
                    log.error("admitting %s failed: %r", entry.rid, e, exc_info=e)
                refused.append((seq, Error(as_service_error(e, "admitting it"))))
        for entry in deferred:
            self.waiting.push(entry)
        if self.kv is not None:
            if not self.waiting:
                self.kv.waiting_for_memory = False
            if self.running:  # the rows grew since the last step: the cache gives way
                self._bound_prefix_cache()
        if reading and not self.running:
            time.sleep(DISK_WAIT_S)  # nothing to step: the engine loop would spin on the read
        return refused

    def _insert(self, seq: Sequence) -> None:
        """Into the runner; a resumed row continues from its prompt + generated tokens (their
        KV is in the prefix cache since its pause), for the tokens it has left."""
        prompt = _prompt_of(seq)
        # Options only runners with supports_choices take (checked at submit).
        extra: dict = {} if seq.req.logprobs is None else {"logprobs": seq.req.logprobs}
        if self.choices.is_leader(seq.req.rid):
            extra["keep_prompt"] = True
        hold_s = seq.req.cache_retention_s or (EDITOR_HOLD_S if class_of(seq.req) == "editor" else None)
        if hold_s and self.runner.supports_cache_hints:
            extra["hold_s"] = hold_s
        if seq.req.cache_namespace and self.runner.supports_cache_scopes:
            extra["namespace"] = seq.req.cache_namespace
        if seq.req.route:  # the gateway routes by prefix: the runner reports what it stores
            extra["route"] = seq.req.route
        row = interfaces.Row(
            prompt, seq.max_tokens - seq.generated, seq.req.sampling, seq.constraint, seq.guard, **extra
        )
        uid, cached = self.runner.insert(row)
        seq.uid = uid
        if seq.marks is not None:  # traced: its steps are counted from now (worker/schedule/trace_marks.py)
            self.traced.add(seq)
        if not seq.paused:
            seq.cached_tokens = cached  # usage reports the first admission's cache hit
        self.prefilled_tokens += len(prompt) - cached
        seq.to_prefill = max(0, len(prompt) - cached - 1)
        seq.phase = Phase.PREFILL if not seq.tokens else Phase.DECODE
        self.running[uid] = seq
        # The cache is cut to what the rows leave at the end of admit, after every lookup:
        # a cut to make room never evicts the prefix a row reuses (its copy is its own).

    def _rows(self) -> list[Row]:
        def row(s: Sequence) -> Row:
            pausable = self._pausable(s) and s.preemptible()
            weight = clean_weight(s.req.weight)
            row = Row(s.req.rid, s.req.tenant or "", weight, s.req.priority, s.generated, pausable, s.to_prefill > 0)
            row.target_s, row.reading = s.target_s, s.to_prefill  # target: read once at its start
            return row

        return [row(s) for s in self.running.values()]

    def _preempt_for_starved(self, seqs: dict[str, Sequence]) -> list[Refused]:
        """Pause one running row when the request next in line has waited beyond the bound
        and a row is held beyond its tenant's share (FairQueue.victim)."""
        full = len(self.running) >= self.max_num_seqs or (self.kv is not None and self.kv.waiting_for_memory)
        if not full or not self.waiting:
            return []
        seq = seqs.get(self.waiting.victim(self._rows(), time.monotonic()) or "")
        if seq is None or seq.uid is None:
            return []
        return self._pause(seq, "tenant share")

    def _preempt_for_memory(self) -> list[Refused]:
        """Pause rows while the rows' KV after the next step would not fit the budget (they
        grew into it: admission counted only a decode allowance each): worker/schedule/kv_rows.py."""
        refused: list[Refused] = []
        if self.kv is None:
            return refused
        while len(self.running) > 1 and self.held() > self.kv.budget_bytes:
            seq = victim((s, self._pausable(s)) for s in self.running.values())
            if seq is None:  # none can be paused: they reserved all they may reach, together
                break
            self.kv.preempted += 1
            refused += self._pause(seq, "KV memory")
        return refused

    def _pause(self, seq: Sequence, why: str) -> list[Refused]:
        """Take seq's row from the runner (its KV goes to the prefix cache) and re-queue it
        at its old place, to resume with its next token."""
        assert seq.uid is not None
        uid = seq.uid
        try:
            self.runner.remove([uid])
        except Exception as e:  # the runner no longer holds it: end it rather than resume blind
            log.warning("pausing %s failed: %r", seq.req.rid, e)
            self.running.pop(uid, None)
            return [(seq, Error(as_service_error(e, "pausing it")))]
        del self.running[uid]
        if self.shared_prefill is not None:
            self.shared_prefill.release(seq)
        self._bound_prefix_cache()
        seq.uid, seq.paused, seq.phase, seq.to_prefill = None, seq.paused + 1, Phase.QUEUED, 0
        self.queue(seq)
        log.info("paused %s (%s) after %d tokens", seq.req.rid, why, seq.generated)
        return []

    def counters(self) -> dict:
        budget = self.prefill
        return {
            "prefilled_tokens": self.prefilled_tokens,
            "max_num_seqs": self.max_num_seqs,
            "prefill_budget": budget.per_step,
            "prefill_step_budget": budget.step_budget if budget.enabled else None,
            "prefill_tokens_per_s": round(budget.pace.tokens_per_s, 1) if budget.pace.tokens_per_s else None,
            "fair_share": self.waiting.enabled,
            "preemptions": self.waiting.preemptions,
            "kv": self.kv_counters(),
        }

    def kv_counters(self) -> dict | None:
        """The KV budget, what the rows reserve and what is free, for /v1/status."""
        if self.kv is None:
            return None
        cache = self.runner.cache_stats().get("bytes", 0)
        rows = list(self.running.values())
        reserves = [reserve(s, self._pausable(s), self.kv.decode_allowance) for s in rows]
        return self.kv.counters(reserves, [after_step(s) for s in rows], cache)


def _prompt_of(seq: Sequence):
    """What a row starts from: its prompt, and what it generated before a pause."""
    # A fresh row passes its prompt object itself: a vision prompt carries its pixels on it.
    return seq.prompt + seq.tokens if seq.tokens else seq.prompt
