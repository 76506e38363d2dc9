"""Fill-in-the-middle prompts: a request's prefix, suffix and other files as the token ids of
the model's own FIM format (shared/fim.py), with the control tokens inserted by id.

Client text never becomes a control token: it is encoded by a copy of the tokenizer that
does not match special tokens (tokenizers' `encode_special_tokens`), with the FIM controls
flagged special in it (Qwen2.5-Coder's tokenizer.json flags them `"special": false`), so
`<|fim_middle|>` or `<|im_start|>` typed in a file reach the model as the plain text they are,
and cannot open another hole, end the file or start a chat turn. A chat prompt that mentions
a FIM control gets it as plain text the same way (`encode_mentions`).

A prompt that does not fit the context keeps what matters most to a completion, as
llama.cpp's /infill does: the other files go first (oldest chunks first), then the far end
of the prefix and of the suffix; the text next to the cursor stays."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ...shared.errors import invalid
from ...shared.fim import FimFormat, detect, from_config

# llama.cpp's names for the repository and the current file when the client names neither.
DEFAULT_REPO = "myproject"
DEFAULT_FILENAME = "filename"
MAX_EXTRA_CHUNKS = 1024  # the gateway refuses more; a worker receiving more refuses too
SUFFIX_SHARE = 4  # a prompt over the context keeps at most 1/4 of its room for the suffix


@dataclass
class FimIds:
    """The control token ids of one model's format."""

    prefix: int
    suffix: int
    middle: int | None
    repo_name: int | None
    file_sep: int | None


class FimPrompts:
    """One model's FIM prompt builder: its format, control ids and the stops they imply."""

    unavailable: str = "its tokenizer has no fill-in-the-middle tokens"  # why encode() refuses

    def __init__(self, tokenizer, config=None):
        """tokenizer: mlx-lm's TokenizerWrapper; config: the entry's FimConfig or None."""
        self._hf = tokenizer._tokenizer
        vocab = self._hf.get_vocab()
        self.format: FimFormat | None = from_config(config, detect(vocab.__contains__))
        self.ids: FimIds | None = None
        self.stop_ids: set[int] = set()
        if self.format is not None:
            self._resolve(vocab)
        bos = getattr(tokenizer, "bos_token_id", None)
        # Models whose tokenizer opens every text with BOS (CodeLlama, DeepSeek-Coder) get it
        # before the FIM prompt too, as llama.cpp gives it.
        self._lead = [bos] if bos is not None and self._hf.encode("a", add_special_tokens=True)[:1] == [bos] else []
        self._plain = None

    def _resolve(self, vocab: dict[str, int]) -> None:
        fmt = self.format
        missing = [t for t in (fmt.prefix, fmt.suffix, fmt.middle) if t is not None and t not in vocab]
        if missing:  # a models.yaml override naming tokens this tokenizer lacks
            self.format, self.unavailable = None, f"its fim tokens {missing} are not in the tokenizer"
            return

        def get(token: str | None) -> int | None:
            return vocab.get(token) if token else None

        self.ids = FimIds(vocab[fmt.prefix], vocab[fmt.suffix], get(fmt.middle), get(fmt.repo_name), get(fmt.file_sep))
        self.stop_ids = {vocab[t] for t in fmt.controls() if t in vocab}

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of client text with special-token matching off."""
        if not text:
            return []
        if self._plain is None:
            backend = getattr(self._hf, "backend_tokenizer", None) or getattr(self._hf, "_tokenizer", None)
            if backend is not None and hasattr(backend, "to_str"):
                from tokenizers import Tokenizer

                # A copy: the shared tokenizer's flag would also change every other encode.
                self._plain = Tokenizer.from_str(self._controls_flagged_special(backend.to_str()))
                self._plain.encode_special_tokens = True
            else:
                self._plain = False
        if self._plain:
            ids = self._plain.encode(text, add_special_tokens=False).ids
        else:
            ids = self._hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        if self.stop_ids.intersection(ids):  # a tokenizer that matched a control token anyway
            raise invalid("the text could not be encoded without the model's control tokens", "suffix")
        return ids

    def _controls_flagged_special(self, tokenizer_json: str) -> str:
        """The tokenizer with the FIM controls flagged special: tokenizers matches an added
        token not flagged special even with encode_special_tokens on."""
        controls = set(self.format.controls()) if self.format is not None else set()
        data = json.loads(tokenizer_json)
        for token in data.get("added_tokens") or []:
            if token.get("content") in controls:
                token["special"] = True
        return json.dumps(data)

    def encode_mentions(self, text: str, encode: Callable[[str], list[int]]) -> list[int] | None:
        """A chat prompt's ids with every FIM control it mentions as plain text (the chat
        template never writes one; a message does), the rest by `encode`; None when it
        mentions none (the common case: the caller encodes it whole)."""
        fmt = self.format
        # Its stops are left out: an end token (<|endoftext|>) is one a chat template may write.
        own = (fmt.prefix, fmt.suffix, fmt.middle, fmt.repo_name, fmt.file_sep) if fmt is not None else ()
        controls = [t for t in own if t and t in text]
        if not controls:
            return None
        pattern = re.compile("|".join(re.escape(t) for t in sorted(controls, key=len, reverse=True)))
        ids, at = [], 0
        for found in pattern.finditer(text):
            ids += encode(text[at : found.start()]) + self._encode_plain(found.group())
            at = found.end()
        return ids + encode(text[at:])

    def encode(self, fim: dict, context_length: int | None, max_tokens: int | None) -> list[int]:
        """The prompt's token ids (fim: GenerateRequest.fim)."""
        if self.ids is None:
            raise invalid(
                f"this model cannot fill in the middle: {self.unavailable}; send the prompt without "
                "'suffix', or name the tokens in its models.yaml entry (fim: prefix, suffix, middle)",
                "suffix",
            )
        prefix, suffix, middle = (_text(fim, k) for k in ("prefix", "suffix", "middle"))
        extra = _chunks(fim.get("extra"))
        ids, fmt = self.ids, self.format
        pre, suf, mid = self._encode_plain(prefix), self._encode_plain(suffix), self._encode_plain(middle)
        controls = 3 + len(self._lead)
        room = None
        if context_length:
            # The answer keeps at most half the context from the prompt; a max_tokens past
            # what is left is then clamped or refused by the budget check, as for any prompt.
            room = context_length - min(max_tokens or 0, context_length // 2) - controls - len(mid)
            if room < 1:
                raise invalid(f"the text after the middle token fills the context ({context_length})", "prompt")
            if len(pre) + len(suf) > room:
                suf = suf[: max(room // SUFFIX_SHARE, room - len(pre))]
                pre = pre[len(pre) - (room - len(suf)) :] if room > len(suf) else []
        head = self._context(extra, fim, None if room is None else room - len(pre) - len(suf))
        if fmt.order == "spm":
            body = [ids.suffix, *suf, ids.prefix, *pre]
            body += [ids.middle, *mid] if ids.middle is not None else mid
        else:
            body = [ids.prefix, *pre, ids.suffix, *suf, *([ids.middle] if ids.middle is not None else []), *mid]
        return [*self._lead, *head, *body]

    def _context(self, extra: list[tuple[str, str]], fim: dict, room: int | None) -> list[int]:
        """Other files before the hole: the repository-level layout where the format has one
        (Qwen2.5-Coder, StarCoder2), else their text; the newest chunks that fit."""
        ids = self.ids
        repo_level = ids.repo_name is not None and ids.file_sep is not None
        filename = _text(fim, "filename")
        if not extra and not (repo_level and filename):
            return []
        if not repo_level:
            chunks = [self._encode_plain(text) for _, text in extra]
            return _newest_fitting([], chunks, [], room)
        head = [ids.repo_name, *self._encode_plain((_text(fim, "repo") or DEFAULT_REPO) + "\n")]
        tail = [ids.file_sep, *self._encode_plain((filename or DEFAULT_FILENAME) + "\n")]
        chunks = [[ids.file_sep, *self._encode_plain(f"{name}\n{text}")] for name, text in extra]
        return _newest_fitting(head, chunks, tail, room)


def _newest_fitting(head: list[int], chunks: list[list[int]], tail: list[int], room: int | None) -> list[int]:
    if room is not None:
        room -= len(head) + len(tail)
        kept = 0
        for chunk in reversed(chunks):
            if len(chunk) > room:
                break
            room -= len(chunk)
            kept += 1
        chunks = chunks[len(chunks) - kept :]
    if room is not None and room < 0:
        return []  # not even the file names fit: the hole alone
    return [*head, *(t for c in chunks for t in c), *tail]


def _text(fim: dict, key: str) -> str:
    value = fim.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise invalid(f"fill-in-the-middle field {key!r} must be a string", key)
    return value


def _chunks(raw) -> list[tuple[str, str]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_EXTRA_CHUNKS:
        raise invalid(f"input_extra must be a list of at most {MAX_EXTRA_CHUNKS} chunks", "input_extra")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise invalid("input_extra chunks must be {filename, text} strings", "input_extra")
        out.append((item[0], item[1]))
    return out


# A suffix line this short ("}", "else:", a blank-ish line) is no evidence of re-typing: a
# middle may well write it itself.
MIN_RETYPED_LINE = 8


def retyped_suffix_stop(fim: dict) -> str | None:
    """The text that shows a middle re-typing its suffix: a new line holding the first line
    after the cursor's (small coder models run past the middle and write the rest of the file
    again, which editors then cut on their side). The middle stops before it; None where the
    suffix has no such line."""
    suffix = fim.get("suffix")
    if not isinstance(suffix, str) or "\n" not in suffix:
        return None
    following = next((line for line in suffix.split("\n")[1:] if line.strip()), None)
    if following is None or len(following.strip()) < MIN_RETYPED_LINE:
        return None
    return "\n" + following
