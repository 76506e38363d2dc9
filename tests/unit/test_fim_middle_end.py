"""A middle ends where a small coder model starts typing the suffix again
(worker/text/fim.py:retyped_suffix_stop, applied by intake as one more stop string)."""

from __future__ import annotations

from mlxgw.worker.text.fim import retyped_suffix_stop
from mlxgw.worker.text.textstream import TextStream


class _Chars:
    """A detokenizer of one character per token, so the stream sees every split."""

    def __init__(self):
        self.text, self.last_segment = "", ""

    def add_token(self, token: int) -> None:
        self.last_segment = chr(token)

    def finalize(self) -> None:
        self.last_segment = ""


def _middle(generated: str, fim: dict) -> str:
    stream = TextStream(_Chars(), [retyped_suffix_stop(fim)])
    out = "".join(stream.push(ord(c)) for c in generated)
    return out + stream.finish()


def test_a_middle_that_types_the_next_line_of_the_suffix_again_ends_before_it():
    fim = {"prefix": "def fib(n):\n    if n < 2:\n", "suffix": "\n    return fib(n - 1) + fib(n - 2)\n"}
    assert retyped_suffix_stop(fim) == "\n    return fib(n - 1) + fib(n - 2)"
    generated = "        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n"
    assert _middle(generated, fim) == "        return n"


def test_the_cursor_mid_line_looks_at_the_line_after_it():
    fim = {"prefix": "x = comp", "suffix": "ute(a, b)\nprint(x, file=sys.stderr)\n"}
    assert retyped_suffix_stop(fim) == "\nprint(x, file=sys.stderr)"


def test_no_stop_where_the_suffix_has_no_telling_line():
    assert retyped_suffix_stop({"suffix": ""}) is None
    assert retyped_suffix_stop({"suffix": "rest of the line"}) is None  # no line after the cursor's
    assert retyped_suffix_stop({"suffix": "\n\n    }\n"}) is None  # too short to tell re-typing
    middle = "    total += x\n"
    assert _middle(middle, {"suffix": "\n    }\n"}) == middle
