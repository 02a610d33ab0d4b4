"""What making a decoded video the same on every rank costs (nodes/same_outputs.py, tp2.same_bytes.same_everywhere):
a float32 [1, T, H, W, 3] frames tensor as ComfyUI's VAE.decode returns it, on two ranks (gloo, the tensors on the
CPU as ComfyUI keeps decoded frames), every rank equal (only digests travel) and rank 1 off (rank 0's bytes are
broadcast). With `cuda`, the ranks share GPU 0 as in the benchmarks' one-GPU mode (their group over gloo).

    python scripts/bench/same_outputs_cost.py 832x480x124,1920x1088x362 [cuda]
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "dist"), os.path.join(ROOT, "tests")]
import torch  # noqa: E402
from harness import run_ranks, values  # noqa: E402


def worker(tp_rank, tp_size, shapes, cuda):
    from tp2 import collectives
    from tp2.collectives import init_tp_group
    from tp2.same_bytes import same_everywhere
    from tp2.settings import read_tp_env

    collectives.group_backend = lambda device: "gloo"  # NCCL refuses two ranks on one GPU; gloo is the CPU's anyway
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tp = init_tp_group(read_tp_env(), dev)
    out = []
    for shape in shapes:
        torch.manual_seed(0)
        t = torch.rand(shape[0], shape[4], shape[1], shape[2], shape[3]).movedim(1, -1)  # [1, T, H, W, C] view
        for case in ("equal", "rank 1 off"):
            if case == "rank 1 off" and tp_rank == 1:
                t.movedim(-1, 1).reshape(-1)[::100003] += 1.0 / 255
            t0 = time.perf_counter()
            differ = same_everywhere(t, tp)
            out.append((shape, case, differ, time.perf_counter() - t0))
        del t
    return out


def main() -> None:
    sizes = [s.split("x") for s in sys.argv[1].split(",")]
    shapes = [(1, int(f), int(h), int(w), 3) for w, h, f in sizes]
    cuda = len(sys.argv) > 2 and sys.argv[2] == "cuda"
    outs = values(run_ranks(worker, 2, shapes, cuda, timeout_s=600, wall_s=1800))
    for r, rows in enumerate(outs):
        for shape, case, differ, secs in rows:
            gb = torch.Size(shape).numel() * 4 / 1e9
            print(
                json.dumps(
                    {
                        "rank": r,
                        "size": f"{shape[3]}x{shape[2]}x{shape[1]}",
                        "GB": round(gb, 3),
                        "case": case,
                        "differ": differ,
                        "s": round(secs, 3),
                    }
                )
            )


if __name__ == "__main__":
    main()
