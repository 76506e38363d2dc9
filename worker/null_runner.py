"""The null engine: a runner that emits tokens as fast as it can without a model.

It measures the gateway, the link and the scheduler on their own (`engine: null` in
models.yaml), and lets protocol tests run without loading weights."""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import GenerateRequest, SamplingParams

from .runner import Runner, StepOutput, TokenOut

_WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]


class _NullDetokenizer:
    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = _WORDS[token % len(_WORDS)] + " "

    def finalize(self) -> None:
        self.last_segment = ""


@dataclass
class _Seq:
    uid: int
    remaining: int
    next_token: int


class NullRunner(Runner):
    def __init__(self, context_length: int | None = None):
        self.context_length = context_length or 32768
        self._seqs: dict[int, _Seq] = {}
        self._uid = 0

    def encode(self, req: GenerateRequest) -> list[int]:
        if req.prompt_tokens is not None:
            return list(req.prompt_tokens)
        if req.messages is not None:
            text = " ".join(str(m.get("content") or "") for m in req.messages)
        else:
            text = req.prompt or ""
        return [len(w) for w in text.split()] or [0]

    def new_detokenizer(self):
        return _NullDetokenizer()

    def insert(self, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> tuple[int, int]:
        self._uid += 1
        self._seqs[self._uid] = _Seq(self._uid, max_tokens, len(prompt))
        return self._uid, 0

    def step(self) -> StepOutput:
        out = StepOutput()
        for seq in list(self._seqs.values()):
            seq.remaining -= 1
            finish = "length" if seq.remaining <= 0 else None
            out.tokens.append(TokenOut(seq.uid, seq.next_token, finish))
            seq.next_token += 1
            if finish:
                del self._seqs[seq.uid]
        return out

    def remove(self, uids: list[int]) -> None:
        for uid in uids:
            self._seqs.pop(uid, None)
