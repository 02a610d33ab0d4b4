"""The whole-video benchmark's phases from ComfyUI's `executing` events (scripts/bench/whole_video.py): each node's
span goes to its phase, the spans feed both the per-phase seconds and the per-phase GPU peaks."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))
import whole_video  # noqa: E402

CLASSES = {"1": "UNETLoader", "5": "KSampler", "9": "VAEDecode", "7": "SaveVideo"}


def _events():
    ev = [(100.0, "execution_start", {})]
    ev += [(t, "executing", {"node": n}) for t, n in ((100.5, "1"), (102.0, "5"), (110.0, "9"), (113.0, "7"), (115.5, None))]
    ev += [(t, "progress", {"node": "5", "value": v}) for t, v in ((104.0, 1), (106.0, 2), (108.0, 3))]
    return ev


def test_phase_spans_are_the_nodes_between_executing_events():
    spans = whole_video.phase_spans(_events(), CLASSES)
    assert spans == [("load", 100.5, 102.0), ("sampling", 102.0, 110.0), ("video decode", 110.0, 113.0), ("mux and save", 113.0, 115.5)]


def test_phases_sum_the_spans_and_time_the_steps():
    out = whole_video.phases(_events(), CLASSES)
    assert (out["load"], out["sampling"], out["video decode"], out["mux and save"]) == (1.5, 8.0, 3.0, 2.5)
    assert out["whole prompt"] == 15.5 and out["s/step"] == 2.0
