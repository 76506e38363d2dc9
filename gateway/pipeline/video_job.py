"""Video frame sampling as a child process (`python -m mlxgw.gateway.pipeline.video_job`, run by
work_pools.run_process_job): a JSON line of sampling settings and limits, then the video's bytes,
on stdin; {"result": {"frames": [base64 JPEG, ...], "fps": ...}} or {"error": why} on stdout.

A container is a program for its demuxer and decoder: a small file can declare a million
frames, a gigapixel picture, or make FFmpeg loop over damaged packets. So the decoding runs
here, where the gateway kills it at its deadline and a memory limit bounds it, never in the
gateway's event loop or the model's worker. What the container declares is checked before a
frame is decoded (duration, frame count, picture size), and the decoding counts what it
really meets (frames decoded, each frame's size), as a declaration can lie.

Frames are chosen as mlx-vlm's `load_video` chooses them for Qwen-VL processors: `fps`
frames a second of the clip, at least `min_frames`, at most `max_frames`, a multiple of
`frame_factor` (the temporal patch), evenly spaced over the clip."""

from __future__ import annotations

import base64
import io
import json
import math


class Refused(ValueError):
    pass


def frame_indices(
    total: int, duration_s: float, fps: float, min_frames: int, max_frames: int, factor: int
) -> list[int]:
    """The frames to keep of a clip of `total` frames: mlx-vlm's load_video rule, with a clip
    shorter than `factor` frames read with repeats (the processor pads the same way)."""
    lo = math.ceil(min_frames / factor) * factor
    hi = max(factor, math.floor(min(max_frames, total) / factor) * factor)
    n = min(max(duration_s * fps, lo), hi)
    n = max(factor, math.floor(n / factor) * factor)
    if total <= 1:
        return [0] * n
    return [round(i * (total - 1) / (n - 1)) for i in range(n)]


def _declared(stream, container) -> tuple[int, float, float]:
    """(frames, duration in s, frame rate) as the container declares them."""
    rate = float(stream.average_rate or stream.guessed_rate or 0) or 0.0
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / 1_000_000
    else:
        duration = 0.0
    frames = int(stream.frames or 0) or (round(duration * rate) if rate else 0)
    if not rate and duration > 0 and frames:
        rate = frames / duration
    return frames, duration, rate


def _check_declared(frames: int, duration: float, width: int, height: int, limits: dict) -> None:
    if frames <= 0 or duration <= 0:
        raise Refused("the video does not declare its length (frames and duration)")
    if duration > limits["max_duration_s"]:
        raise Refused(f"the video is {duration:.0f} s long; the limit is {limits['max_duration_s']:.0f} s")
    if frames > limits["max_source_frames"]:
        raise Refused(f"the video declares {frames:,} frames; the limit is {limits['max_source_frames']:,}")
    if width <= 0 or height <= 0 or width * height > limits["max_source_pixels"]:
        raise Refused(f"the video is {width}x{height} pixels; the limit is {limits['max_source_pixels']:,} a frame")


def _encoded(frame, max_pixels: int) -> str:
    image = frame.to_image()  # RGB, PIL
    scale = math.sqrt(max_pixels / (image.width * image.height))
    if scale < 1:
        image = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=92)
    return base64.b64encode(out.getvalue()).decode()


def sample(data: bytes) -> dict:
    import av

    header, _, video = data.partition(b"\n")
    settings = json.loads(header)
    limits = settings["limits"]
    try:
        container = av.open(io.BytesIO(video), metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError) as e:
        raise Refused(f"the data is not a video this server can read ({getattr(e, 'strerror', None) or e})") from None
    with container:
        if not container.streams.video:
            raise Refused("the file has no video stream")
        stream = container.streams.video[0]
        frames, duration, rate = _declared(stream, container)
        ctx = stream.codec_context
        _check_declared(frames, duration, ctx.width, ctx.height, limits)
        wanted = frame_indices(
            frames, duration, settings["fps"], settings["min_frames"], settings["max_frames"], settings["frame_factor"]
        )
        picked = _decode(container, stream, wanted, limits)
    return {"frames": picked, "fps": len(wanted) / duration, "duration_s": duration, "source_frames": frames}


def _decode(container, stream, wanted: list[int], limits: dict) -> list[str]:
    """The frames at the `wanted` indices, decoding in order and stopping at the last one."""
    import av

    picked: list[str] = []
    last = wanted[-1]
    seen = 0
    try:
        for frame in container.decode(stream):
            if frame.width * frame.height > limits["max_source_pixels"]:
                raise Refused(
                    f"a frame is {frame.width}x{frame.height} pixels; the limit is {limits['max_source_pixels']:,}"
                )
            while len(picked) < len(wanted) and wanted[len(picked)] == seen:
                picked.append(_encoded(frame, limits["max_frame_pixels"]))
            seen += 1
            if seen > last:
                break
            if seen > limits["max_source_frames"]:
                raise Refused(f"the video has more than {limits['max_source_frames']:,} frames")
    except av.FFmpegError as e:
        raise Refused(f"the video could not be decoded ({getattr(e, 'strerror', None) or e})") from None
    if len(picked) < len(wanted):
        raise Refused(f"the video ends after {seen} frames, before its declared length (truncated?)")
    return picked


if __name__ == "__main__":
    from ..web.work_pools import job_main

    job_main(sample)
