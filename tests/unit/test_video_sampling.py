"""Which frames a video gives, and what is refused before a frame is decoded
(gateway/pipeline/video_job.py): the rule is mlx-vlm's load_video, checked against it."""

from __future__ import annotations

import pytest

from mlxgw.gateway.pipeline.video import LIMITS
from mlxgw.gateway.pipeline.video_job import Refused, _check_declared, frame_indices

LIMITS_DICT = LIMITS.__dict__


@pytest.mark.parametrize(
    "total,duration,fps,max_frames,count",
    [
        (30, 3.0, 2.0, 64, 6),
        (30, 3.0, 2.0, 4, 4),
        (30, 3.0, 4.0, 12, 12),
        (30, 3.0, 5.0, 64, 14),
        (3000, 100, 2, 64, 64),
    ],
)
def test_frame_counts_follow_mlx_vlm(total, duration, fps, max_frames, count):
    indices = frame_indices(total, duration, fps, 4, max_frames, 2)
    assert len(indices) == count and indices[0] == 0 and indices[-1] == total - 1
    assert indices == sorted(indices)


def test_a_one_frame_clip_repeats_its_frame():
    assert frame_indices(1, 0.1, 2.0, 4, 64, 2) == [0, 0]


@pytest.mark.parametrize(
    "frames,duration,width,height,message",
    [
        (0, 0.0, 64, 64, "does not declare its length"),
        (100, 3600.0, 64, 64, "the limit is 600 s"),
        (1_000_000, 10.0, 64, 64, "declares 1,000,000 frames"),
        (30, 3.0, 100_000, 100_000, "100000x100000 pixels"),
    ],
)
def test_declared_bombs_are_refused_before_decoding(frames, duration, width, height, message):
    with pytest.raises(Refused, match=message):
        _check_declared(frames, duration, width, height, LIMITS_DICT)


def test_the_sampled_frames_kept_are_bounded_in_entries_and_bytes():
    from mlxgw.gateway.pipeline.video import _Sampled

    kept = _Sampled()
    for i in range(kept.MAX_ENTRIES + 3):
        kept.put((i,), {"frames": [b"x" * 10], "fps": 2.0})
    assert kept.get((0,)) is None and kept.get((kept.MAX_ENTRIES + 2,)) is not None
    kept.put(("big",), {"frames": [b"x" * (kept.MAX_BYTES // 2)] * 2, "fps": 2.0})
    assert kept._bytes() <= kept.MAX_BYTES
