"""scripts/tp2-submit names the first stage at which two ranks' outputs differ: the sampler's latent, the decoded
frames, the audio, or only the video container (real MP4 files written with PyAV)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_submit

av = pytest.importorskip("av")


def _mp4(path, frame_shift=0, audio_shift=0.0, comment="") -> str:
    """5 frames of 64x64 with 0.2 s of stereo audio; `frame_shift` moves one pixel of frame 3 by that many levels."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 200, (5, 64, 64, 3), dtype=np.uint8)
    frames[3, 10, 10] += frame_shift
    sound = (rng.standard_normal((2, 4800)) * 0.1).astype(np.float32)
    sound[:, 100:400] += audio_shift
    with av.open(str(path), "w", format="mp4") as out:
        if comment:
            out.metadata["comment"] = comment
        video = out.add_stream("libx264", rate=24, options={"crf": "0"})
        video.width = video.height = 64
        video.pix_fmt = "yuv444p"
        audio = out.add_stream("aac", rate=24000, layout="stereo")
        for f in frames:
            out.mux(video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(video.encode())
        frame = av.AudioFrame.from_ndarray(sound, format="fltp", layout="stereo")
        frame.sample_rate = 24000
        out.mux(audio.encode(frame))
        out.mux(audio.encode())
    return str(path)


def test_the_stage_that_differs_is_named(tmp_path):
    submit = load_submit()
    base = _mp4(tmp_path / "a.mp4")
    assert "the decoded frames differ (first at frame 3" in submit.where_media_differ(base, _mp4(tmp_path / "b.mp4", frame_shift=40))
    assert submit.where_media_differ(base, _mp4(tmp_path / "c.mp4", audio_shift=0.3)) == "the frames are equal, the audio differs"
    container_only = _mp4(tmp_path / "d.mp4", comment="rank 1")
    assert open(base, "rb").read() != open(container_only, "rb").read()
    assert submit.where_media_differ(base, container_only) == "the frames and the audio are equal: only the container differs"
    outs = [
        {"node 9 latents[0]": (str(tmp_path / "a.latent"), "st:1"), "node 7 images[0]": (base, "x")},
        {"node 9 latents[0]": (str(tmp_path / "b.latent"), "st:2"), "node 7 images[0]": (container_only, "y")},
    ]
    assert submit.first_difference(outs) == "the sampler's latent already differs (node 9 latents[0])"
    outs[1]["node 9 latents[0]"] = outs[0]["node 9 latents[0]"]
    assert submit.first_difference(outs) == "the frames and the audio are equal: only the container differs (node 7 images[0])"
