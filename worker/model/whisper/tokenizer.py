"""Whisper's tokens: text through the model's tokenizer.json, special ids by their names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# Whisper's language codes in token order (openai/whisper tokenizer.py); the model's
# `lang_ids` say how many of them it has.
LANGUAGE_CODES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
    "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
    "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()


@dataclass
class WhisperTokens:
    tokenizer: Tokenizer
    vocab_size: int
    sot: int
    eot: int
    transcribe: int
    translate: int | None
    sot_prev: int
    no_timestamps: int
    timestamp_begin: int
    no_speech: int | None
    languages: dict[str, int]  # code -> token id (only "en" for English-only models)
    multilingual: bool
    suppress: list[int]
    suppress_begin: list[int]
    alignment_heads: list[tuple[int, int]]

    @classmethod
    def load(cls, folder: Path, vocab_size: int) -> WhisperTokens:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        extra = json.loads((folder / "whisper.json").read_text())

        def tid(text: str) -> int | None:
            return tok.token_to_id(text)

        lang_ids = extra.get("lang_ids") or []
        languages = {}
        for code in LANGUAGE_CODES:
            i = tid(f"<|{code}|>")
            if i is not None and (not lang_ids or i in lang_ids):
                languages[code] = i
        multilingual = vocab_size >= 51865
        if not multilingual:
            languages = {"en": languages.get("en", tid("<|en|>"))}
        no_ts = tid("<|notimestamps|>")
        return cls(
            tokenizer=tok,
            vocab_size=vocab_size,
            sot=tid("<|startoftranscript|>"),
            eot=tid("<|endoftext|>"),
            transcribe=tid("<|transcribe|>"),
            translate=tid("<|translate|>") if multilingual else None,
            sot_prev=tid("<|startofprev|>"),
            no_timestamps=no_ts,
            timestamp_begin=no_ts + 1,
            no_speech=tid("<|nospeech|>") or tid("<|nocaptions|>"),
            languages=languages,
            multilingual=multilingual,
            suppress=list(extra.get("suppress_ids") or []),
            suppress_begin=list(extra.get("suppress_ids_begin") or []),
            alignment_heads=[tuple(h) for h in extra.get("alignment_heads") or []],
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.eot])

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        seq = [self.sot]
        if self.multilingual:
            seq.append(self.languages[language or "en"])
            seq.append(self.translate if task == "translate" else self.transcribe)
        return seq
