"""Regenerate the test clips offline: espeak-ng speech, resampled to 16 kHz mono with PyAV.

apt-get install -y espeak-ng && .venv/bin/python tests/data/audio/make_clips.py
"""

import io
import json
import subprocess
from pathlib import Path

import av

HERE = Path(__file__).parent
# file name -> (espeak-ng voice, text, container, codec)
CLIPS = {
    "fox.wav": ("en-us", "The quick brown fox jumps over the lazy dog.", "wav", "pcm_u8"),
    "paris.flac": ("en-us", "Paris is the capital of France. It is a beautiful city.", "flac", "flac"),
    "weather.mp3": ("en-us", "The weather today is sunny, with a light breeze from the west.", "mp3", "libmp3lame"),
    "meeting.ogg": ("en-us", "Please send the report to the team before the meeting on Monday.", "ogg", "libopus"),
    "german.flac": ("de", "Guten Morgen. Das Wetter ist heute sehr schön.", "flac", "flac"),
}


def encode(wav: bytes, container: str, codec: str) -> bytes:
    src = av.open(io.BytesIO(wav))
    out_buf = io.BytesIO()
    out = av.open(out_buf, mode="w", format=container)
    rate = 48000 if codec == "libopus" else 16000  # Opus runs at 48 kHz
    stream = out.add_stream(codec, rate=rate, layout="mono")
    if codec == "libmp3lame":
        stream.bit_rate = 32000
    resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=rate)
    for frame in src.decode(audio=0):
        for f in resampler.resample(frame):
            out.mux(stream.encode(f))
    for f in resampler.resample(None):
        out.mux(stream.encode(f))
    out.mux(stream.encode(None))
    out.close()
    return out_buf.getvalue()


def main() -> None:
    texts = {}
    for name, (voice, text, container, codec) in CLIPS.items():
        wav = subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "--stdout", text], check=True, capture_output=True)
        (HERE / name).write_bytes(encode(wav.stdout, container, codec))
        texts[name] = {"text": text, "language": voice[:2]}
    (HERE / "clips.json").write_text(json.dumps(texts, indent=2) + "\n")


if __name__ == "__main__":
    main()
