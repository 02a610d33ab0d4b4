"""tp2/capacity.py against the peaks it was calibrated on (docs/PERFORMANCE.md) and the sequence ComfyUI builds."""

from __future__ import annotations

import os

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
    assert capacity.advice(1920, 1088, 362, 2, 22.0) == "at 1920x1088 up to 175 frames fit"  # tp 4 needs ~23.1: no size to suggest


def test_the_table_command(capsys):
    assert capacity.main(["--gpu-mem", "22", "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    # resident, streamed (cudaMallocAsync), streamed with --lean-memory: the README's table
    assert "| 1920x1088 | 175 (7.3 s, 21.4) | 243 (10.1 s, 20.8) | 277 (11.5 s, 21.1) |" in out, out
    assert capacity.main(["--gpu-mem", "22", "--fast"]) == 0  # the 362 frames measured with --fast
    assert "| 1920x1088 | 260 (10.8 s, 21.6) | 362 (15.1 s, 21.2) | 413 (17.2 s, 21.6) |" in capsys.readouterr().out
    assert "| 832x480 |" in out


# the README's "Will it run on my machine?": cards, GiB per rank, split
README_ROWS = (("2x RTX 2080 Ti 22 GB", [22.0, 22.0], (1, 1), "fp32"), ("2x RTX 3090 24 GB", [24.0, 24.0], (1, 1), "bf16"),
               ("3090 + 2080 Ti", [24.0, 22.0], (7, 6), "fp32"))  # fmt: skip


@pytest.mark.parametrize("cards,gpus,shares,dtype", README_ROWS)
def test_the_readme_shows_what_the_model_predicts_per_card_class(cards, gpus, shares, dtype):
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    row = next(line for line in readme.splitlines() if line.startswith(f"  | {cards}"))
    assert f"| {dtype} " in row, row
    for w, h in ((1920, 1088), (832, 480)):
        frames = [capacity.longest_on_every_rank(w, h, gpus, shares, streamed, dtype=dtype)[0] for streamed in (False, True)]
        assert f"| {frames[0]} ({frames[0] / 24:.1f} s) / {frames[1]} ({frames[1] / 24:.1f} s) |" in row, (w, h, row)


@pytest.mark.parametrize(
    "width,height,frames,dtype,fast,live",
    [(832, 480, 124, "bf16", False, 1.42), (1920, 1088, 73, "bf16", False, 4.17), (1920, 1088, 124, "bf16", False, 6.98),
     (832, 480, 124, "fp32", False, 2.48), (1920, 1088, 73, "fp32", False, 7.38), (1920, 1088, 124, "fp32", False, 12.37),
     (1600, 896, 124, "fp32", False, 8.54), (1600, 896, 124, "bf16", True, 3.40), (1920, 1088, 362, "bf16", True, 14.14)],
)  # fmt: skip
def test_streamed_live_within_10_percent_per_dtype_and_setting(width, height, frames, dtype, fast, live):
    # one H200, both TP2 ranks on it, dynamic VRAM (docs/PERFORMANCE.md, The capacity model): a rank's live tensors
    # are its activations (the streamed weights are dynamic VRAM's, not torch's)
    predicted = capacity.activations_gib(capacity.tokens(width, height, frames), 2, dtype=dtype, fast=fast)
    assert abs(predicted - live) / live < 0.10, (predicted, live)


def test_pool_over_live_gives_the_measured_pools():
    # 1920x1088x362, --fast, a real 2 x 22 GiB: torch's pool 18.52 GiB (expandable segments), 17.48 (native)
    n = capacity.tokens(1920, 1088, 362)
    in_flight = capacity.WEIGHTS_GIB / 2 * capacity.STREAMED_BLOCKS / capacity.BLOCKS + capacity.CONTEXT_GIB
    for allocator, pooled in (("expandable", 18.52), ("native", 17.48)):
        pool = capacity.predict_peak_gib(n, 2, streamed=True, allocator=allocator, fast=True) - in_flight
        assert abs(pool - pooled) / pooled < 0.05, (allocator, pool, pooled)


def test_streaming_needs_less_and_the_lean_allocator_less_again():
    n = capacity.tokens(1920, 1088, 362)
    resident = capacity.predict_peak_gib(n, 2, fast=True)
    streamed = capacity.predict_peak_gib(n, 2, streamed=True, fast=True)
    lean = capacity.predict_peak_gib(n, 2, streamed=True, allocator=capacity.LEAN_ALLOCATOR, fast=True)
    assert capacity.LEAN_ALLOCATOR == "native"  # not expandable segments: dynamic VRAM cannot free weights for those
    expandable = capacity.predict_peak_gib(n, 2, streamed=True, allocator="expandable", fast=True)
    assert lean < expandable < streamed < 22.0 < resident
    msg = capacity.advice(1920, 1088, 362, 2, 20.5, streamed=True)
    assert msg == "at 1920x1088 up to 226 frames fit", msg  # tp 4 needs more than 20.5 GiB too
    msg = capacity.advice(1920, 1088, 362, 2, 20.5, streamed=True, fast=True)
    assert msg.startswith("at 1920x1088 up to 345 frames fit, or start the ranks with --lean-memory (~19.1 GiB per rank)"), msg
    # already lean (or on expandable segments): no allocator to suggest
    assert "--lean-memory" not in capacity.advice(1920, 1088, 362, 2, 18.0, streamed=True, allocator="native")
    assert "--lean-memory" not in capacity.advice(1920, 1088, 362, 2, 18.0, streamed=True, allocator="expandable")


def test_the_allocator_is_named_from_torch_and_its_conf():
    assert capacity.allocator_of("cudaMallocAsync", "") == "cudaMallocAsync"
    assert capacity.allocator_of("native", "garbage_collection_threshold:0.8,expandable_segments:True") == "expandable"
    assert capacity.allocator_of("native", "expandable_segments:False") == "native"
    assert capacity.allocator_of("native", "") == "native"


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_a_fraction_of_one_over_tp_size_is_the_even_split_bit_for_bit(tp_size):
    f = 1 / tp_size
    for n in (1_000, capacity.tokens(1920, 1088, 175), 200_000):
        for streamed, allocator in ((False, capacity.ASYNC), (True, capacity.ASYNC), (True, "native")):
            how = dict(streamed=streamed, allocator=allocator)
            assert capacity.predict_peak_gib(n, tp_size, fraction=f, **how) == capacity.predict_peak_gib(n, tp_size, **how)
            assert capacity.predict_peak_gib(n, tp_size, 3.3, 2688, fraction=f, **how) == capacity.predict_peak_gib(
                n, tp_size, 3.3, 2688, **how
            )
        assert capacity.activations_gib(n, tp_size, fraction=f) == capacity.activations_gib(n, tp_size)
    assert capacity.longest_frames(1920, 1088, 22.0, tp_size, fraction=f) == capacity.longest_frames(1920, 1088, 22.0, tp_size)
    assert capacity.advice(1920, 1088, 362, tp_size, 20.5, True, fraction=f) == capacity.advice(1920, 1088, 362, tp_size, 20.5, True)
    assert capacity.longest_frames(1920, 1088, 22.0, 2, fraction=0.5) == 175  # the measured answer, through the fraction


def test_a_larger_fraction_needs_more_memory():
    n = capacity.tokens(1920, 1088, 362)
    for streamed in (False, True):
        small, even, large = (capacity.predict_peak_gib(n, 2, streamed=streamed, fraction=f) for f in (0.4, 0.5, 0.6))
        assert small < even < large, (small, even, large)
    # resident: the weights and the split activations scale with the fraction, the fixed buffers and shared rows do not
    more = capacity.predict_peak_gib(n, 2, fraction=0.6) - capacity.predict_peak_gib(n, 2)
    assert more == pytest.approx(0.1 * (capacity.WEIGHTS_GIB + n * capacity.SPLIT_PER_TOKEN_GIB))
    assert capacity.longest_frames(1920, 1088, 22.0, 2, fraction=0.6) < 175 < capacity.longest_frames(1920, 1088, 22.0, 2, fraction=0.4)
    # a bigger tp_size in the advice keeps the rank's share relative to an even one (2/3 at tp 2 -> 1/3 at tp 4)
    assert (
        capacity.advice(1920, 1088, 362, 2, 26.5, fraction=2 / 3)
        == "at 1920x1088 up to 175 frames fit, or use tp_size 4 (~26.1 GiB per rank)"
    )
    assert capacity.advice(1920, 1088, 362, 2, 26.5).endswith("or use tp_size 4 (~23.1 GiB per rank)")


def test_the_default_split_follows_the_memory_in_small_whole_numbers():
    assert capacity.memory_shares([24, 12]) == (2, 1)
    assert capacity.memory_shares([24, 16]) == (3, 2)
    assert capacity.memory_shares([24, 11]) == (2, 1)  # within 2% of 24:11
    assert capacity.memory_shares([22, 22]) == (1, 1)
    assert capacity.memory_shares([24, 16, 16, 12]) == (4, 3, 3, 2)  # within 2% of 6:4:4:3


def test_the_rank_that_limits_a_mixed_pair():
    assert capacity.longest_on_every_rank(1920, 1088, [24, 12], (1, 1), streamed=True) == (124, 1)
    assert capacity.longest_on_every_rank(1920, 1088, [12, 24], (1, 1), streamed=True) == (124, 0)
    assert capacity.longest_on_every_rank(1920, 1088, [12, 24], (1, 1), streamed=True)[0] == capacity.longest_frames(
        1920, 1088, 12, 2, streamed=True
    )


def _rows(out: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells[1:]
        for line in out.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }


def test_the_command_for_mixed_gpus(capsys):
    assert capacity.main(["--gpu-mem", "24,12"]) == 0  # tp_size 2 and split 2:1 from the list
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["resolution"] == [
        "resident 2:1",
        "resident even",
        "streamed 2:1",
        "streamed even",
        "--lean-memory 2:1",
        "--lean-memory even",
    ]
    assert rows["1920x1088"][2:4] == ["141 (5.9 s), rank 1", "124 (5.2 s)"], out  # the 12 GiB rank limits both
    for w, h in capacity.RESOLUTIONS:
        cells = rows[f"{w}x{h}"]
        for split, even in zip(cells[::2], cells[1::2]):
            assert split.endswith(", rank 1") and int(split.split()[0]) >= int(even.split()[0]), (split, even)
    assert capacity.main(["--gpu-mem", "22", "--split", "3:2"]) == 0  # one size, uneven shares: rank 0 holds more
    assert _rows(capsys.readouterr().out)["1920x1088"][2:4] == ["226 (9.4 s), rank 0", "243 (10.1 s)"]


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--gpu-mem", "24,x"], "'24,x' is not GiB per GPU"),
        (["--gpu-mem", "24,-12"], "one positive number (every GPU) or one per rank"),
        (["--gpu-mem", "24,12", "--split", "3:2:1"], "split '3:2:1' is not 2 positive whole numbers"),
        (["--gpu-mem", "24,12", "--tp-size", "4"], "--gpu-mem names 2 GPUs for tp_size 4"),
    ],
)
def test_the_command_refuses_a_bad_list_with_what_to_write(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        capacity.main(argv)
    assert e.value.code != 0
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    "width,height,frames,dtype,live",
    [(832, 480, 124, "bf16", 10.89), (1920, 1088, 73, "bf16", 13.65), (1920, 1088, 124, "bf16", 16.46),
     (832, 480, 124, "fp32", 12.10), (1920, 1088, 73, "fp32", 17.00), (1920, 1088, 124, "fp32", 21.98)],
)  # fmt: skip
def test_resident_live_within_10_percent_per_dtype(width, height, frames, dtype, live):
    # one H200, both TP2 ranks on it, --highvram, 2026-12-04 (docs/PERFORMANCE.md, The capacity model): the live peak
    # is the predicted peak less the fixed part live tensors do not count
    predicted = capacity.predict_peak_gib(capacity.tokens(width, height, frames), 2, dtype=dtype) - capacity.FIXED_GIB[2]
    assert abs(predicted - live) / live < 0.10, (predicted, live)
