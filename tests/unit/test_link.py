"""tp2/link.py without a process group: the link's kind from `nvidia-smi topo` as users paste it, and the pair model
of docs/PERFORMANCE.md (Mixed cards) reproduced from its own inputs."""

from __future__ import annotations

import pytest

from tp2.link import HOST, kind_from_topo, link_kind, predict_speedup, verdict

MATRIX_NVLINK = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV2\t0-23\t0\t\tN/A
GPU1\tNV2\t X \t0-23\t0\t\tN/A

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
MATRIX_PCIE = MATRIX_NVLINK.replace("NV2", "PHB")
P2P_OK = """\
 \tGPU0\tGPU1
 GPU0\tX\tOK
 GPU1\tOK\tX

Legend:
  OK   = Status Ok
  CNS  = Chipset not supported
"""
P2P_NO = P2P_OK.replace("\tOK", "\tCNS")


@pytest.mark.parametrize(
    "matrix,p2p,gpus,kind",
    [
        (MATRIX_NVLINK, P2P_OK, ["0", "1"], "NVLink (NV2)"),
        (MATRIX_PCIE, P2P_OK, ["0", "1"], "PCIe peer-to-peer (PHB)"),
        (MATRIX_PCIE, P2P_NO, ["1", "0"], "through host memory (PCIe without peer-to-peer)"),
        (MATRIX_PCIE, P2P_OK, ["0", "0"], "one GPU (ranks share it)"),
        (MATRIX_PCIE, P2P_OK, ["0", "3"], "unknown (nvidia-smi topo does not list GPUs 0,3)"),
    ],
    ids=["nvlink", "p2p", "host", "shared", "unlisted"],
)
def test_kind_from_nvidia_smi_topo(matrix, p2p, gpus, kind):
    assert kind_from_topo(matrix, p2p, gpus) == kind


def test_gloo_goes_through_host_memory_without_asking_nvidia_smi():
    assert link_kind("gloo", ["", ""]) == HOST == "gloo, host memory"


# docs/PERFORMANCE.md, Mixed cards, 832x480x124 (15,100 tokens) with --fast (bf16 all-reduce, 10 GB/s): the slower rank
# at the even split 184.6 ms (3090 + 2080 Ti) and 139.9 ms (4090 + 3090) per block, the faster card alone 13.4 and
# 5.8 s/step of 50 blocks, collectives 32.5 ms per block; the table says 1.23x and 0.67x
@pytest.mark.parametrize("fast_alone_s,slow_rank_ms,expected", [(13.4, 184.6, 1.23), (5.8, 139.9, 0.67)])
def test_the_pair_model_gives_the_documented_speedups(fast_alone_s, slow_rank_ms, expected):
    blocks = [fast_alone_s / 50, 2 * slow_rank_ms / 1e3]
    speedup, comm = predict_speedup(blocks, (1, 1), 10.0, 15_100, 5376, 2)
    assert comm * 1e3 == pytest.approx(32.5, abs=0.05)
    assert round(speedup, 2) == expected


def test_shares_move_work_to_the_faster_card_and_bus_bandwidth_counts_every_rank():
    even, _ = predict_speedup([0.010, 0.030], (1, 1), 1e9, 256, 336, 4)  # an endless link: compute only
    three_to_one, _ = predict_speedup([0.010, 0.030], (3, 1), 1e9, 256, 336, 4)
    assert even == pytest.approx(0.010 / 0.015) and three_to_one == pytest.approx(0.010 / 0.0075)
    _, two = predict_speedup([1.0, 1.0], (1, 1), 10.0, 1000, 1000, 4)
    _, four = predict_speedup([1.0] * 4, (1,) * 4, 10.0, 1000, 1000, 4)
    assert four == pytest.approx(two * 1.5)  # bus bandwidth: 2 (n - 1) / n of the bytes cross each link


def test_under_1_2x_the_verdict_says_tp_buys_memory_not_speed():
    assert verdict(1.19, (3, 1)) == (
        "predicted 1.19x the fastest card alone at 3:1: TP buys memory here, not speed (longer or larger videos than one card holds)"
    )
    assert verdict(1.34, (3, 2)) == "predicted 1.34x the fastest card alone at 3:2"
