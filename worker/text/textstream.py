"""Incremental text for one sequence: detokenize token by token and cut at stop strings.

UTF-8 sequences split across tokens are handled by mlx-lm's streaming detokenizer. Stop
strings may span tokens, so we hold back the shortest tail that could still become a stop
string; nothing after (or of) a matched stop string is ever emitted."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer


def exact_text(detokenizer):
    """The detokenizer of a continuation (a completion, a fill in the middle): its text is
    exactly the decoding of its tokens. mlx-lm's streaming detokenizers trim the first space of
    a generation, right for a chat answer and wrong for a text appended to its prompt
    (`" Paris"` came back as `"Paris"`; a middle lost a space of its indentation)."""
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    elif isinstance(detokenizer, BPEStreamingDetokenizer):
        detokenizer._maybe_trim_space = _as_is  # its only trim, made a no-op for this copy
    return detokenizer


def _as_is(text: str) -> str:
    return text


class TextStream:
    def __init__(self, detokenizer, stop: list[str]):
        self._detok = detokenizer
        self._stops = [s for s in stop if s]
        self._pending = ""  # decoded but not yet emitted (may be a stop-string prefix)
        self.stop_match: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_match is not None

    def push(self, token: int) -> str:
        """Add a token; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._detok.add_token(token)
        return self._release(self._detok.last_segment)

    def finish(self) -> str:
        """End of generation: flush the detokenizer and everything held back."""
        if self.stopped:
            return ""
        self._detok.finalize()
        text = self._release(self._detok.last_segment)
        if self.stopped:
            return text
        text, self._pending = text + self._pending, ""
        return text

    def _release(self, segment: str) -> str:
        if not self._stops:
            return segment
        self._pending += segment
        buf = self._pending
        cut = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (cut is None or i < cut):
                cut, self.stop_match = i, s
        if cut is not None:
            self._pending = ""
            return buf[:cut]
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]
