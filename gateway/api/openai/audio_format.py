"""A transcription's segments as OpenAI's response formats: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

import json
import math

from ....shared.events import Finish

# Whisper's language codes -> the names OpenAI's verbose_json reports.
LANGUAGE_NAMES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian", "ko": "korean",
    "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish", "pl": "polish", "ca": "catalan",
    "nl": "dutch", "ar": "arabic", "sv": "swedish", "it": "italian", "id": "indonesian", "hi": "hindi",
    "fi": "finnish", "vi": "vietnamese", "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay",
    "cs": "czech", "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian", "la": "latin",
    "cy": "welsh", "sk": "slovak", "fa": "persian", "lv": "latvian", "sr": "serbian", "sl": "slovenian",
    "et": "estonian", "mk": "macedonian", "is": "icelandic", "hy": "armenian", "kk": "kazakh", "sw": "swahili",
    "gl": "galician", "af": "afrikaans", "be": "belarusian", "bs": "bosnian", "mr": "marathi", "ne": "nepali",
}  # fmt: skip


def _clock(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[dict]) -> str:
    blocks = [
        f"{i}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text'].strip()}\n"
        for i, s in enumerate(segments, 1)
    ]
    return "\n".join(blocks)


def vtt(segments: list[dict]) -> str:
    blocks = [f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n" for s in segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


def verbose(task: str, done: Finish, text: str) -> dict:
    segments = [
        {
            "id": s["id"],
            "seek": int(s["start"] // 30) * 3000,
            "start": s["start"],
            "end": s["end"],
            "text": s["text"],
            "tokens": s["tokens"],
            "temperature": s["temperature"],
            "avg_logprob": s["avg_logprob"],
            "compression_ratio": s["compression_ratio"],
            "no_speech_prob": s["no_speech_prob"],
        }
        for s in done.segments or ()
    ]
    language = done.language or "en"
    words = {"words": done.words} if done.words is not None else {}
    return {
        "task": task,
        "language": "english" if task == "translate" else LANGUAGE_NAMES.get(language, language),
        "duration": done.duration,
        "text": text,
        "segments": segments,
        **words,
        "usage": {"type": "duration", "seconds": math.ceil(done.duration)},
    }


def render(fmt: str, task: str, done: Finish) -> tuple[str, str]:
    """(body, content type) of a finished transcription."""
    text = "".join(s["text"] for s in done.segments or ()).strip()
    if fmt == "text":
        return text + "\n", "text/plain"
    if fmt == "srt":
        return srt(done.segments or []), "text/plain"
    if fmt == "vtt":
        return vtt(done.segments or []), "text/vtt"
    if fmt == "verbose_json":
        return json.dumps(verbose(task, done, text), ensure_ascii=False), "application/json"
    usage = {"type": "duration", "seconds": math.ceil(done.duration)}
    return json.dumps({"text": text, "usage": usage}, ensure_ascii=False), "application/json"
