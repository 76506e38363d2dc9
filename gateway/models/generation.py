"""One generation as the API modules see it: start on a worker, stream events, end once.

Used as `async with Generation(...) as gen`: leaving the block early (client gone, handler
cancelled, write timeout) cancels the request in the worker, which frees its sequence and
KV at the next engine step."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Accepted, AnyEvent, Delta, Error, Finish, FinishReason, Progress, PromptLogprobs, Usage
from ..link.broker import Broker, RequestStream
from ..link.route_key import LazyRoute
from .manager import ModelManager, ModelSlot
from .token_gaps import GapHistogram

# Keep-alives during a model load commit the HTTP status (200) with the first byte, after
# which a refusal (prompt too long, bad tool schema) can only be an error event. So they start
# only once a load has run long enough that a client could time out waiting for headers.
LOAD_KEEPALIVE_AFTER_S = 20.0

# Gateway-side safety margin over the worker's own timeout: if the worker says nothing at
# all for this long past the deadline, the request ends with an error anyway.
DEADLINE_SLACK_S = 30.0
RATE_SAMPLE_MIN_TOKENS = 8  # a shorter answer says little about the decode rate


@dataclass
class Outcome:
    text: str
    finish_reason: FinishReason
    stop: str | None
    usage: Usage
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # per token, when the request asked
    index: int = 0
    # n > 1: every choice's outcome, by index (this one first); empty for one choice.
    choices: list[Outcome] = field(default_factory=list)


class BlankTextFilter:
    """Whitespace-only text before a tool call (after another one, or at the start) is left
    out: it would be a text block or message item of its own ("\n" between two calls), which
    Anthropic refuses when a client sends it back. Such whitespace is held until text that is
    not blank follows (then it is sent with it), or the output ends without any tool call."""

    def __init__(self) -> None:
        self.held = ""
        self.in_text = False  # text that is not blank has been sent since the last tool call
        self.any_calls = False

    def filter(self, event: Delta | Finish) -> Delta | Finish:
        calls = event.tool_calls
        if self.in_text and not calls:
            return event  # text after text (nothing is held then): the common case, unchanged
        text = event.text or ""
        if text and not self.in_text:
            if text.isspace():
                self.held, text = self.held + text, ""
            else:
                self.held, text, self.in_text = "", self.held + text, True
        if calls:
            self.held, self.in_text, self.any_calls = "", False, True
        elif type(event) is Finish and self.held and not self.any_calls:
            self.held, text = "", self.held + text
        if text == (event.text or ""):
            return event
        return dataclasses.replace(event, text=text)


# A worker refuses new requests once it drains; a request that raced the drain tries again.
DRAINING_RETRIES = 2


def _refused_while_draining(event: AnyEvent) -> bool:
    return type(event) is Error and event.error.code is ErrorCode.MODEL_UNAVAILABLE


def raise_for(event: AnyEvent) -> None:
    """Turn a terminal error (or a cancellation) into the ServiceError the API renders."""
    if type(event) is Error:
        # a copy: one lost worker's error event object ends all of its streams at once
        raise event.error.copy()
    if type(event) is Finish and event.reason is FinishReason.CANCELLED:
        raise ServiceError(ErrorCode.CANCELLED, "the request was cancelled")


class Generation:
    def __init__(
        self,
        manager: ModelManager,
        slot: ModelSlot,
        req: p.WorkerRequest,
        keepalive_s: float = 5.0,
        owner: str | None = None,
        session: str | None = None,
    ):
        self.manager = manager
        # Where its prompt's prefix may be cached (a model's replicas: gateway/link/pool.py);
        # session: the id the client gave its session, if any (gateway/pipeline/cache_hints.py).
        self.route = LazyRoute(req, session)
        self.owner = owner  # API key name
        self.keepalive_s = keepalive_s
        # Called every keepalive_s while the model loads (streams send SSE comments).
        self.on_wait: Callable[[], Awaitable[None]] | None = None
        # Called before waiting for the worker when no event is ready (a stream sends what
        # it gathered from the events that were: SSEWriter.hold).
        self.before_wait: Callable[[], Awaitable[None]] | None = None
        self.broker: Broker = manager.broker
        self.slot = slot
        self.req = req
        self.stream: RequestStream | None = None
        self.accepted: Accepted | None = None
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.outcome: str | None = None  # finish reason, or error:CODE
        self.token_gaps = GapHistogram()  # seconds per token between deltas (inter-token latency)
        self._last_delta: tuple[float, int] | None = None
        self.usage = Usage()
        # The prompt's logprob entries, when the request asked (Completions' echo + logprobs):
        # sent once, before the first output (shared/protocol.py PromptLogprobs).
        self.prompt_logprobs: list[dict] | None = None
        # Gateway-side backstop, two-phase like the worker's own timeout: until the first
        # token the queue + prefill bound, then the generation bound from the first token.
        self._timeout_s = getattr(req, "timeout_s", None) or 300
        first = getattr(req, "prefill_timeout_s", None) or self._timeout_s
        self._first_bound_s = first
        self._deadline = self.started + first + DEADLINE_SLACK_S
        self.time_limited = False  # the answer was cut by its time bound (finish reason length)
        self._ended_by: ServiceError | None = None  # ended from outside (end_with)
        self._stopping: asyncio.Future | None = None
        self.worker_trace: dict | None = None  # a traced request's worker times (pipeline/worker_spans.py)

    @property
    def model_name(self) -> str:
        """The model responses name: a LoRA adapter's request names its adapter."""
        return getattr(self.req, "adapter", None) or self.slot.name

    async def _load_tick(self) -> None:
        if self.on_wait is not None and time.monotonic() - self.started >= LOAD_KEEPALIVE_AFTER_S:
            await self.on_wait()

    async def __aenter__(self) -> Generation:
        for tries_left in range(DRAINING_RETRIES, -1, -1):
            conn = await self.manager.acquire(self.slot, self._load_tick, self.keepalive_s, self.route)
            try:
                # inside: a refusal here (the quarantine's 400) is logged with its real outcome
                self.stream = await self.broker.submit(conn, self.req, self.owner)
                if self._ended_by is not None:  # ended while it waited for its worker
                    self.end_with(self._ended_by)
                first = await self._next(None)
                retry = tries_left > 0 and _refused_while_draining(first)
                if type(first) is not Accepted and not retry:
                    raise_for(first)
                    raise ServiceError(ErrorCode.INTERNAL, f"unexpected first event {first.KIND.value!r}")
            except BaseException as e:
                # `async with` runs no __aexit__ when __aenter__ raises: a client that leaves
                # before the worker accepted (or a timeout here) must still cancel the request,
                # or the worker would generate for nobody until max_tokens.
                await self.__aexit__(type(e), e, e.__traceback__)
                raise
            if not retry:
                break
            # It reached a worker in the instant a reload or unload began to drain it: nothing
            # ran, so wait for the model's current slot like any other request.
            self.slot = self.manager.slots.get(self.slot.name, self.slot)
        self.accepted = first
        self.usage.prompt_tokens = first.prompt_tokens
        return self

    def end_with(self, err: ServiceError) -> None:
        """End this generation from outside, err its terminal event as if the worker had sent
        it (a newer request superseded it): its reader answers err in its API's shape, and the
        worker is told to stop. Before the worker took it, it ends as soon as it is sent."""
        self._ended_by = err
        stream = self.stream
        if stream is not None and not stream.done:
            stream.push(Error(error=err))
            self._stopping = asyncio.ensure_future(self.broker.stop(stream))

    async def __aexit__(self, exc_type, exc, tb) -> None:
        # A stream that ends early (client gone, write timeout, crash) is still accounted
        # truthfully: the tokens it delivered and why it ended, for limits, metrics and logs.
        delivered = self._last_delta[1] if self._last_delta else 0
        self.usage.completion_tokens = max(self.usage.completion_tokens, delivered)
        if self.outcome is None and exc_type is not None:
            code = exc.code if isinstance(exc, ServiceError) else ErrorCode.INTERNAL
            cancelled = issubclass(exc_type, asyncio.CancelledError) or code == ErrorCode.CANCELLED
            self.outcome = "cancelled" if cancelled else f"error:{code.value}"
        if self.stream is not None and not self.stream.done:
            try:
                await self.broker.cancel(self.stream)
            except ServiceError:
                pass  # the worker is gone; nothing left to cancel
        self.slot.last_used = time.monotonic()
        self._note_decode_rate()

    def _note_decode_rate(self) -> None:
        """One stream's tokens per second after its first, smoothed over requests: what a
        request without max_tokens is capped by (api/translate.rate_cap)."""
        n = self.usage.completion_tokens
        if self.first_token_at is None or n < RATE_SAMPLE_MIN_TOKENS:
            return
        seconds = time.monotonic() - self.first_token_at
        if seconds <= 0:
            return
        rate, old = (n - 1) / seconds, self.slot.decode_tokens_per_s
        self.slot.decode_tokens_per_s = rate if old is None else 0.7 * old + 0.3 * rate

    async def _next(self, timeout: float | None) -> AnyEvent:
        stream = self.stream
        if stream.ready():  # the hot path: a step's events are already here
            return stream.take()
        if self.before_wait is not None:
            await self.before_wait()
        remaining = self._deadline - time.monotonic()
        wait = remaining if timeout is None else min(timeout, remaining)
        try:
            return await self.stream.next(max(wait, 0.001))
        except asyncio.TimeoutError:
            if time.monotonic() >= self._deadline:
                raise ServiceError(ErrorCode.TIMEOUT, "the model worker stopped answering") from None
            raise

    def _mark_tokens(self, n_total: int) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self._deadline = now + self._timeout_s + DEADLINE_SLACK_S
        elif self._last_delta is not None and n_total > self._last_delta[1]:
            then, before = self._last_delta
            gap = (now - then) / (n_total - before)
            self.token_gaps.add(gap, n_total - before)
        self._last_delta = (now, n_total)

    def _note(self, event: AnyEvent) -> type[AnyEvent]:
        """The bookkeeping of every event from the worker (token times, outcome, usage); its class."""
        kind = type(event)
        if kind is Delta:
            self._mark_tokens(event.n)
        elif kind is PromptLogprobs:
            self.prompt_logprobs = list(event.entries)
        elif kind is Progress and self.first_token_at is None:
            # The worker's prefill bound scales with the prompt and its host's measured rate
            # (worker/prefill_plan.prefill_bound); this backstop only catches a silent worker.
            self._deadline = max(self._deadline, time.monotonic() + self._first_bound_s + DEADLINE_SLACK_S)
        if (kind is Delta or kind is Progress) and event.cached is not None:
            # the first delta, or prefill progress: a stream cut before its finish still logs its cache hit
            self.usage.cached_tokens = event.cached
        elif kind is Finish:
            if event.trace is not None:
                self.worker_trace = event.trace
            self.outcome = event.reason.value
            self.time_limited = bool(event.time_limited)
            self.usage = event.usage or self.usage
            if self.route.key is not None:  # one of several workers: did its cache serve it?
                self.broker.pool.observed(self.stream.conn, self.route.key, self.usage)
            if self.first_token_at is None and event.text:
                self.first_token_at = time.monotonic()
        elif kind is Error:
            if event.trace is not None:
                self.worker_trace = event.trace
            self.outcome = f"error:{event.error.code.value}"
            self.usage = event.usage or self.usage
        return kind

    async def events(self) -> AsyncIterator[AnyEvent | None]:
        """Delta, progress, finish and error events; None when nothing came for keepalive_s.
        Ends after the terminal event."""
        while True:
            try:
                event = await self._next(self.keepalive_s)
            except asyncio.TimeoutError:
                yield None
                continue
            kind = self._note(event)
            yield event
            if kind is Finish or kind is Error:
                return

    async def content(self, on_idle: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[Delta | Finish]:
        """Delta and finish events only, whitespace between tool calls left out (see
        BlankTextFilter). on_idle runs on keep-alive ticks and prefill progress (streams send
        a comment or ping); an error or a cancellation raises ServiceError. (The loop of
        events() is inlined: one generator less per token.)"""
        blanks: dict[int, BlankTextFilter] = {}  # per choice (n > 1)
        while True:
            try:
                event = await self._next(self.keepalive_s)
            except asyncio.TimeoutError:
                event = None
            kind = self._note(event) if event is not None else None
            if kind is None or kind is Progress:
                if on_idle is not None:
                    await on_idle()
                continue
            if kind is not Delta:
                raise_for(event)  # an error raises; a cancellation too
            if kind is Delta or kind is Finish:
                index = event.index or 0
                blank = blanks.get(index)
                if blank is None:
                    blank = blanks[index] = BlankTextFilter()
                yield blank.filter(event)
            if kind is Finish:
                return

    async def finish_event(self) -> Finish:
        """The terminal event of a request that streams nothing (embeddings, reranking)."""
        async for event in self.content():
            if type(event) is Finish:
                return event
        raise ServiceError(ErrorCode.INTERNAL, "the request ended without a finish event")

    async def result(self) -> Outcome:
        """The whole output; with n > 1 choices, choice 0's with all of them in `choices`."""
        parts: dict[int, dict] = {}
        async for event in self.content():
            part = parts.setdefault(event.index or 0, {"text": [], "reasoning": [], "calls": [], "lp": []})
            part["text"].append(event.text or "")
            part["reasoning"].append(event.reasoning or "")
            part["calls"].extend(event.tool_calls or [])
            part["lp"].extend(event.logprobs or [])
            if type(event) is Finish:
                return self._outcome(parts, event)
        raise ServiceError(ErrorCode.INTERNAL, "generation ended without a finish event")

    def _outcome(self, parts: dict[int, dict], finish: Finish) -> Outcome:
        outcomes = []
        for end in finish.ends():
            part = parts.get(end["index"]) or {"text": [], "reasoning": [], "calls": [], "lp": []}
            text, reasoning, calls = "".join(part["text"]), "".join(part["reasoning"]), part["calls"]
            reason, stop, lp = end["reason"], end.get("stop"), part["lp"]
            outcomes.append(Outcome(text, reason, stop, self.usage, reasoning, calls, lp, end["index"]))
        first = outcomes[0]
        if len(outcomes) > 1:
            first.choices = outcomes
        return first
