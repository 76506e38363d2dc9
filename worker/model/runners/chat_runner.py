"""The text side every chat runner shares (the MLX and vision runners): prompts, detokenizing,
output parsing and constraints are delegated to a ChatText (worker/text/chat_text.py)."""

from __future__ import annotations

from ....shared.protocol import GenerateRequest
from ...text.chat_text import ChatText
from ..interfaces import TextRunner


class ChatTextRunner(TextRunner):
    """A runner whose text side is a ChatText (self.text, set by the subclass): prompts,
    detokenizing, output parsing and constraints are delegated to it."""

    text: ChatText

    def encode(self, req: GenerateRequest) -> list[int]:
        return self.text.encode(req)

    def encode_text(self, text: str) -> list[int]:
        return self.text.encode_text(text)

    def new_detokenizer(self):
        return self.text.new_detokenizer()

    def make_parser(self, req: GenerateRequest, prompt: list[int]):
        return self.text.make_parser(req, prompt)

    def make_constraint(self, req: GenerateRequest):
        return self.text.make_constraint(req)
