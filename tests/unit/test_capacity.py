"""tp2/capacity.py against the peaks it was calibrated on (docs/PERFORMANCE.md) and the sequence ComfyUI builds."""

from __future__ import annotations

import pytest

from tp2 import capacity


@pytest.mark.parametrize("width,height,frames,tp_size,measured", capacity.MEASURED)
def test_prediction_within_5_percent_of_each_measured_peak(width, height, frames, tp_size, measured):
    predicted = capacity.predict_peak_gib(capacity.tokens(width, height, frames), tp_size)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_sequence_rows_are_the_ones_comfyui_builds():
    # the server log of the H200 run (docs/PERFORMANCE.md, session 6): "sequence parallel: 15100 rows" at 832x480x124
    assert capacity.tokens(832, 480, 124) == 15100
    assert capacity.frames_on_grid(120) == 124 and capacity.frames_on_grid(124) == 124


def test_longest_lengths_on_22_gib_cards():
    # measured: 1920x1088 x175 peaks at 21.4-21.5 GiB per TP2 rank, the next length (192) is predicted above 22 GiB
    assert capacity.longest_frames(1920, 1088, 22.0, 2) == 175
    assert capacity.longest_frames(1920, 1088, 21.0, 2) == 158  # the measured answer of session 4
    assert capacity.longest_frames(1920, 1088, 10.0, 2) is None
    assert capacity.advice(1920, 1088, 362, 2, 22.0).startswith("at 1920x1088 up to 175 frames fit, or use tp_size 8")


def test_the_table_command(capsys):
    assert capacity.main(["--gpu-mem", "22", "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1920x1088 | 175 | 7.3 |" in out and "| 832x480 |" in out
