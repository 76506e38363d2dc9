"""One prefill per prefix in flight.

Agents of one team start together with the same system prompt and tools: admitted at once,
each row would read that prefix itself, and the prefix cache would only help the next
wave. Instead, a waiting prompt that shares a long prefix with a row still reading it (past
what that row took from the cache) asks that row to publish its prompt's KV to the block
store at its first token (as choice 0 does for its sibling choices) and waits for it; then it
reads only what it adds. A resend of a prompt whose first copy is still prefilling waits the
same way. A prompt arriving once that row decodes, before it finished (its blocks would only
reach the store at its end), asks it to publish its KV now and waits that one step. Rows
nobody waits on publish nothing early: no memory beyond the KV budget's."""

from __future__ import annotations

from collections.abc import Iterable

from .sequence import Phase, Sequence

# A wait is worth it only for a prefix this long (a few prefill chunks); below it the rows
# read their prompts side by side as before.
MIN_SHARED_TOKENS = 256


def shared_prefix(a: list[int], b: list[int]) -> int:
    n, step, i = min(len(a), len(b)), 64, 0
    while i + step <= n and a[i : i + step] == b[i : i + step]:  # whole slices: compared in C
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def worth_keeping(prompt) -> bool:
    """Whether a prompt is long enough for others to wait for its KV (keep it at its first token)."""
    return type(prompt) is list and len(prompt) >= MIN_SHARED_TOKENS


def reading_same_prefix(seq: Sequence, running: Iterable[Sequence]) -> Sequence | None:
    """A running row that read (prefilling, or decoding since) at least MIN_SHARED_TOKENS of
    seq's prompt that the cache did not give it, or None. Resumed rows (tokens generated) and
    prompts carrying images do not wait. Only a row of the same cache scope (namespace and
    adapter) is waited for: another scope's reading must not show in this one's timing."""
    if seq.tokens or not worth_keeping(seq.prompt):
        return None
    scope = (seq.req.cache_namespace, seq.req.adapter)
    for other in running:
        if (other.req.cache_namespace, other.req.adapter) != scope:
            continue
        prefilling = other.phase == Phase.PREFILL and not other.tokens
        decoding = other.phase == Phase.DECODE and not other.paused  # a paused row's KV is stored
        if not (prefilling or decoding) or type(other.prompt) is not list:
            continue
        if shared_prefix(seq.prompt, other.prompt) - other.cached_tokens >= MIN_SHARED_TOKENS:
            return other
    return None


class SharedPrefill:
    """Admission's side: which rows were asked to publish their prompt, by request id."""

    def __init__(self, runner) -> None:
        self.runner = runner  # with publish_prompt(uid): keep that row's prompt KV at its next token
        self.publishing: dict[str, int] = {}  # request id -> the step it was asked in
        self.steps = 0

    def start_step(self) -> None:
        """A step's admission begins: rows asked before have stepped since."""
        self.steps += 1

    def waits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether seq should wait for a row that read its prefix (asked to publish it)."""
        leader = reading_same_prefix(seq, running)
        if leader is None or leader.uid is None:
            return False
        asked = self.publishing.get(leader.req.rid)
        if asked is None:
            self.runner.publish_prompt(leader.uid)
            self.publishing[leader.req.rid] = asked = self.steps
        # A prefilling row publishes with its first token; a decoding one with its next, in
        # the step after the one it was asked in (published since: what it stored is looked up).
        return leader.phase == Phase.PREFILL or asked == self.steps

    def release(self, seq: Sequence) -> None:
        self.publishing.pop(seq.req.rid, None)
