"""The null engine: a runner that emits tokens as fast as it can without a model.

It measures the gateway, the link and the scheduler on their own (`engine: null` in
models.yaml), and lets protocol tests run without loading weights."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ....shared.errors import invalid
from ....shared.events import FinishReason
from ....shared.protocol import GenerateRequest
from ..interfaces import Row, StepOutput, TextRunner, TokenOut

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


class NullRunner(TextRunner):
    def __init__(self, context_length: int | None = None):
        # Tests only (tests/e2e/test_progress.py): a load that takes this long, so its
        # progress can be watched; unset everywhere else.
        time.sleep(float(os.environ.get("MLXGW_TEST_NULL_LOAD_S") or 0))
        self.context_length = context_length or 32768
        self._seqs: dict[int, _Seq] = {}
        self._uid = 0

    def encode(self, req: GenerateRequest) -> list[int]:
        _refuse_fim(req)
        if req.prompt_tokens is not None:
            return list(req.prompt_tokens)
        if req.messages is not None:
            text = " ".join(str(m.get("content") or "") for m in req.messages)
        else:
            text = req.prompt or ""
        return [len(w) for w in text.split()] or [0]

    def new_detokenizer(self):
        return _NullDetokenizer()

    def insert(self, row: Row) -> tuple[int, int]:
        self._uid += 1
        self._seqs[self._uid] = _Seq(self._uid, row.max_tokens, len(row.prompt))
        return self._uid, 0

    def step(self) -> StepOutput:
        out = StepOutput()
        for seq in list(self._seqs.values()):
            seq.remaining -= 1
            finish = FinishReason.LENGTH if seq.remaining <= 0 else None
            out.tokens.append(TokenOut(seq.uid, seq.next_token, finish))
            seq.next_token += 1
            if finish:
                del self._seqs[seq.uid]
        return out

    def remove(self, uids: list[int]) -> None:
        for uid in uids:
            self._seqs.pop(uid, None)


class _ByteDetokenizer:
    """Token ids are UTF-8 bytes; multi-byte characters are released once complete."""

    def __init__(self) -> None:
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = self._decoder.decode(bytes([token % 256]))

    def finalize(self) -> None:
        self.last_segment = self._decoder.decode(b"", final=True)


class EchoRunner(NullRunner):
    """The echo engine: answers with the text of the last non-system message, byte by byte.

    It lets the whole output path (stop strings, reasoning and tool-call parsing, every
    API's rendering, the SDKs' stream assembly) be tested with exact, known model output."""

    def __init__(
        self, context_length: int | None = None, tool_parser: str | None = None, reasoning_parser: str | None = None
    ):
        super().__init__(context_length)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._scripts: dict[int, list[int]] = {}

    def encode(self, req: GenerateRequest) -> list[int]:
        _refuse_fim(req)
        if req.messages:
            # The last turn to answer: a system turn after it (Claude Code sends one) instructs.
            turns = [m for m in req.messages if m.get("role") != "system"] or req.messages
            text = str(turns[-1].get("content") or "")
        else:
            text = req.prompt or ""
        return list(text.encode()) or [32]

    def new_detokenizer(self):
        return _ByteDetokenizer()

    def make_parser(self, req: GenerateRequest, prompt: list[int]):
        from ...text.output_parser import OutputParser, think_tags, tool_syntax

        think = think_tags(self.reasoning_parser, None)
        tool = tool_syntax(self.tool_parser, None) if req.tools else None
        return OutputParser(think=think, tool=tool, tools=req.tools) if (think or tool) else None

    def insert(self, row: Row) -> tuple[int, int]:
        uid, cached = super().insert(row)
        self._scripts[uid] = list(row.prompt)
        return uid, cached

    def step(self) -> StepOutput:
        out = StepOutput()
        for seq in list(self._seqs.values()):
            script = self._scripts[seq.uid]
            if not script:  # the whole message was said: end of sequence
                out.tokens.append(TokenOut(seq.uid, 0, FinishReason.STOP))
                self.remove([seq.uid])
                continue
            seq.remaining -= 1
            finish = FinishReason.LENGTH if seq.remaining <= 0 else None
            out.tokens.append(TokenOut(seq.uid, script.pop(0), finish))
            if finish:
                self.remove([seq.uid])
        return out

    def remove(self, uids: list[int]) -> None:
        super().remove(uids)
        for uid in uids:
            self._scripts.pop(uid, None)


def _refuse_fim(req: GenerateRequest) -> None:
    if req.fim is not None:
        raise invalid("this engine has no tokenizer to fill in the middle with; send no 'suffix'", "suffix")
