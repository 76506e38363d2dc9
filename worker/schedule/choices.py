"""n > 1: one request, n choices sampled from one prompt.

A request with n choices becomes n sequences inside the worker (internal ids `rid#i`),
choice i sampling with seed + i (so the choices differ, and each equals the single-choice
answer with that seed). Choice 0 is admitted first; its prompt KV goes to the prefix cache
with its first token, and the other choices are admitted after that, so they prefill one
token each and decode in the same batch as choice 0.

Their events are merged back into one stream for the gateway: one Accepted, choice 0's
prefill progress, each choice's deltas tagged with its `index` (`n`: the tokens of all
choices so far), each choice's last output as a Delta, and one Finish once every choice has
ended, with the usage of all of them (the prompt counted once, as OpenAI does) and every
choice's finish reason. A choice that fails fails the request: the others are cancelled."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...shared import protocol as p
from ...shared.events import (
    TERMINAL_EVENTS,
    Accepted,
    AnyEvent,
    Delta,
    Error,
    Finish,
    Progress,
    PromptLogprobs,
    Usage,
)

MAX_CHOICES = 16
SEP = "#"


@dataclass
class Group:
    rid: str
    n: int
    pending: set[int]
    accepted: bool = False
    failed: bool = False
    tokens: list[int] = field(default_factory=list)  # completion tokens per choice so far
    ends: dict[int, dict] = field(default_factory=dict)  # index -> {index, reason, stop}
    usage: Usage = field(default_factory=Usage)


def choice_rid(rid: str, index: int) -> str:
    return f"{rid}{SEP}{index}"


class ChoiceGroups:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.members: dict[str, tuple[Group, int]] = {}  # internal rid -> (group, index)

    def expand(self, req: p.GenerateRequest) -> list[p.GenerateRequest]:
        """The request's choices as single-choice requests (the caller checked n)."""
        group = Group(req.rid, req.n, set(range(req.n)), tokens=[0] * req.n)
        self.groups[req.rid] = group
        out = []
        for i in range(req.n):
            seed = req.sampling.seed + i if req.sampling.seed is not None else None
            sampling = dataclasses.replace(req.sampling, seed=seed)
            # The prompt's logprobs are the same for every choice: choice 0 computes them.
            prompt_logprobs = req.prompt_logprobs if i == 0 else None
            choice = dataclasses.replace(
                req, rid=choice_rid(req.rid, i), n=1, sampling=sampling, prompt_logprobs=prompt_logprobs
            )
            self.members[choice.rid] = (group, i)
            out.append(choice)
        return out

    def internal_rids(self, rid: str) -> list[str]:
        """The live choices of a request, or [] when rid is not a request with choices."""
        group = self.groups.get(rid)
        return [choice_rid(rid, i) for i in sorted(group.pending)] if group else []

    def is_follower(self, rid: str) -> str | None:
        """The internal id of choice 0 when rid is another choice of the same request."""
        member = self.members.get(rid)
        return choice_rid(member[0].rid, 0) if member and member[1] > 0 else None

    def is_leader(self, rid: str) -> bool:
        member = self.members.get(rid)
        return bool(member and member[1] == 0 and member[0].n > 1)

    def merge(self, events: list[p.Event]) -> tuple[list[p.Event], list[str]]:
        """Events with choices merged into their request's stream, and the internal ids of
        choices to cancel (the siblings of a choice that failed)."""
        out: list[p.Event] = []
        cancel: list[str] = []
        for rid, ev in events:
            member = self.members.get(rid)
            if member is None:
                out.append((rid, ev))
                continue
            group, index = member
            if isinstance(ev, TERMINAL_EVENTS):
                self._ended(rid, group, index)
            if group.failed:
                continue
            out += self._merge_one(group, index, ev, cancel)
        return out, cancel

    def _ended(self, rid: str, group: Group, index: int) -> None:
        group.pending.discard(index)
        del self.members[rid]
        if not group.pending:
            self.groups.pop(group.rid, None)

    def _merge_one(self, group: Group, index: int, ev: AnyEvent, cancel: list[str]) -> list[p.Event]:
        if isinstance(ev, Accepted):
            if group.accepted:
                return []
            group.accepted = True
            return [(group.rid, ev)]
        if isinstance(ev, (Progress, PromptLogprobs)):
            return [(group.rid, ev)] if index == 0 else []
        if isinstance(ev, Error):
            group.failed = True
            cancel += [choice_rid(group.rid, i) for i in sorted(group.pending)]
            return [(group.rid, ev)]
        if isinstance(ev, Delta):
            group.tokens[index] = ev.n
            return [(group.rid, dataclasses.replace(ev, index=index, n=sum(group.tokens)))]
        if isinstance(ev, Finish):
            return self._finish(group, index, ev)
        return []

    def _finish(self, group: Group, index: int, ev: Finish) -> list[p.Event]:
        out: list[p.Event] = []
        usage = ev.usage or Usage()
        group.tokens[index] = usage.completion_tokens
        if index == 0:
            group.usage.prompt_tokens, group.usage.cached_tokens = usage.prompt_tokens, usage.cached_tokens
        group.usage.completion_tokens += usage.completion_tokens
        last = {k: getattr(ev, k) for k in ("text", "reasoning", "tool_calls", "logprobs") if getattr(ev, k)}
        if last:
            out.append((group.rid, Delta(n=sum(group.tokens), index=index, **{"text": "", **last})))
        group.ends[index] = {"index": index, "reason": ev.reason, "stop": ev.stop}
        if len(group.ends) == group.n:
            first = group.ends[0]
            ends = [group.ends[i] for i in range(group.n)]
            out.append((group.rid, Finish(first["reason"], group.usage, text="", stop=first["stop"], choices=ends)))
        return out
