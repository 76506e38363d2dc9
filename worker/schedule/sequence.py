"""One generation request's state inside the worker, from submit to its last event.

A request is an `Intake` while it is prepared (template, tokens, grammar: worker/schedule/preprocess.py),
then a `Sequence` through its phases:

    PREPARING -> QUEUED [-> SCORING -> QUEUED] -> PREFILL -> DECODE -> DONE
                   ^                                            |
                   +------- paused (fair share, KV memory) -----+

SCORING: its prompt logprobs are computed before it is admitted (worker/model/runners/prompt_logprobs.py).
A paused row goes back to QUEUED with its generated tokens kept and resumes with the next
one. A phase is what /v1/status lists per request, so its string values are part of the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...shared import protocol as p
from ...shared.errors import ServiceError, invalid
from ...shared.events import Phase, Usage  # Phase re-exported: the worker's phases are the wire's
from ..model.runners.isolation import SequenceGuard
from ..text.output_parser import OutputParser, Parsed
from .budget import ThinkingBudget, check_budget
from .latency import target_of
from .trace_marks import TraceMarks, marks_for

if TYPE_CHECKING:
    from ..model.interfaces import TextRunner
    from ..model.runners.prompt_logprobs import PromptScorer
    from ..text.textstream import TextStream

MAX_PAUSES = 3  # a row preempted this often runs to its end (it would otherwise never finish)


@dataclass
class Prepared:
    """What preparation makes of a request: its prompt and the per-sequence helpers."""

    prompt: list[int]
    max_tokens: int
    parser: OutputParser | None
    constraint: Any  # a logits processor (or a list of them), or None


def prepare(req: p.GenerateRequest, runner: TextRunner, policy: str) -> Prepared:
    """Template, tokenize and build the sequence's helpers (runs off the engine thread).
    policy: what a max_tokens past the context does (worker/schedule/budget.py), unless req says."""
    try:
        prompt = runner.encode(req)
    except ServiceError:
        raise
    except Exception as e:  # the tokenizer refused this input (odd code points, ...): its sender's fault
        param = "messages" if req.messages is not None else "prompt"
        raise invalid(f"the prompt could not be tokenized: {type(e).__name__}: {e}", param) from None
    if not prompt:
        raise invalid("the prompt is empty", "prompt")
    max_tokens = check_budget(len(prompt), req.max_tokens, runner.context_length, req.max_tokens_policy or policy)
    constraint = runner.make_constraint(req)
    parser = runner.make_parser(req, prompt)
    if req.reasoning_budget is not None and parser is not None and parser.think:
        budget = ThinkingBudget(parser, req.reasoning_budget, runner.encode_text(parser.think[1]))
        constraint = [budget] + ([constraint] if constraint else [])
    return Prepared(prompt, max_tokens, parser, constraint)


@dataclass
class Intake:
    """A request between submit and admission, while it is prepared."""

    req: p.GenerateRequest
    arrival: int  # its place in the queue
    arrived: float  # time.monotonic() at submit

    def listing(self, now: float) -> dict:
        return {
            "id": self.req.rid,
            "phase": Phase.PREPARING.value,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "age_s": round(now - self.arrived, 3),
            "ttft_s": None,
        }


@dataclass
class Sequence:
    req: p.GenerateRequest
    prompt: list[int]
    max_tokens: int
    arrived: float
    deadline: float | None
    text: TextStream
    guard: SequenceGuard
    phase: Phase = Phase.QUEUED
    uid: int | None = None  # the runner's row while admitted
    cached_tokens: int = 0
    prefilled: int = 0  # prompt tokens past the cached ones computed so far (progress)
    to_prefill: int = 0  # prompt tokens the runner still has to read before the last one
    generated: int = 0
    first_token_at: float | None = None
    parser: OutputParser | None = None  # splits reasoning and tool calls out of the text
    constraint: Any = None  # logits processor enforcing a grammar
    unsent: Parsed = field(default_factory=Parsed)
    unsent_tokens: int = 0
    unsent_logprobs: list[dict] = field(default_factory=list)
    sent_delta: bool = False  # the first delta carries cached_tokens
    scorer: PromptScorer | None = None  # until its prompt logprobs are computed
    arrival: int = 0  # its place in the queue (kept when a preempted row re-queues)
    tokens: list[int] = field(default_factory=list)  # generated so far: a resumed row's prompt grows by them
    paused: int = 0  # times preempted
    marks: TraceMarks | None = None  # its times, when the gateway traces it (worker/schedule/trace_marks.py)
    target_s: float = 0.0  # its latency class's target time to first token (worker/schedule/latency.py)

    @classmethod
    def start(cls, intake: Intake, prepared: Prepared, text: TextStream) -> Sequence:
        """The queued sequence of a prepared request."""
        req = intake.req
        return cls(
            req=req,
            prompt=prepared.prompt,
            max_tokens=prepared.max_tokens,
            arrived=intake.arrived,
            deadline=first_deadline(req, intake.arrived),
            text=text,
            guard=SequenceGuard(req.rid),
            parser=prepared.parser,
            constraint=prepared.constraint,
            arrival=intake.arrival,
            marks=marks_for(req, intake.arrived),
            target_s=target_of(req),
        )

    def resumable(self) -> bool:
        """Rows that can resume exactly from prompt + generated tokens: no grammar or
        per-token state outside the tokens, no sibling choices, no media to re-encode."""
        req = self.req
        return (
            self.constraint is None
            and req.logprobs is None
            and req.n == 1
            and not (req.images or req.videos or req.audio)
            and self.scorer is None
        )

    def preemptible(self) -> bool:
        """Whether fair share may pause it: resumable, and not paused too often already
        (memory pauses it whenever it must: worker/schedule/kv_rows.py)."""
        return self.resumable() and self.paused < MAX_PAUSES

    def usage(self) -> Usage:
        return Usage(len(self.prompt), self.generated, self.cached_tokens)

    def listing(self, now: float) -> dict:
        """Its entry in /v1/status's request list."""
        return {
            "id": self.req.rid,
            "phase": self.phase.value,
            "prompt_tokens": len(self.prompt),
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated,
            # long prompts: how far the prefill has got (cached tokens count as done)
            "prefilled_tokens": len(self.prompt) if self.first_token_at else self.cached_tokens + self.prefilled,
            "age_s": round(now - self.arrived, 3),
            "ttft_s": round(self.first_token_at - self.arrived, 3) if self.first_token_at else None,
        }


def prefill_timeout(req: p.GenerateRequest) -> float | None:
    """The bound on queue + prompt processing (its first token's deadline)."""
    return req.prefill_timeout_s or req.timeout_s


def first_deadline(req: p.GenerateRequest, arrived: float) -> float | None:
    """Until its first token a sequence is bounded by the queue + prefill timeout."""
    bound = prefill_timeout(req)
    return arrived + bound if bound else None
