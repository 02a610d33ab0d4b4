"""What the launcher sets for the link between the ranks' GPUs, before any rank starts: the link's kind (tp2/link.py,
from nvidia-smi's topology), then NAME=VALUE lines: TP2_WIRE (pick_wire) and NCCL's published settings for that kind.

    link_settings.py 0,1     (run with the pack's folder on PYTHONPATH)
"""

from __future__ import annotations

import sys

from tp2.link import NCCL_FOR_KIND, NO_P2P, link_kind
from tp2.wire import EXACT, INT8


def pick_wire(kind: str, tp_size: int) -> str:
    """TP2_WIRE from the link's kind: int8 through PCIe or host memory (the model: it halves the bf16 reduce's bytes),
    exact on NVLink or one GPU. `start-tp2.sh check` picks from measured figures instead (scripts/lib/balance.py)."""
    return INT8 if tp_size == 2 and (kind.startswith("PCIe") or kind == NO_P2P) else EXACT


if __name__ == "__main__":
    gpus = sys.argv[1].split(",")
    kind = link_kind("nccl", gpus)
    print(kind, f"TP2_WIRE={pick_wire(kind, len(gpus))}", *(f"{k}={v}" for k, v in NCCL_FOR_KIND.get(kind, {}).items()), sep="\n")
