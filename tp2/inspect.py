"""`python -m tp2.inspect CKPT --tp-size N [--json]`: print the resolved plan, or the reason there is none.

Exit 0 with the plan (each tensor: style, full shape, per-rank shape); exit 2 with the error message.
"""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import CheckpointLayout
from .errors import TP2Error
from .plan import resolve_plan
from .split import parse_split


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp2.inspect", description="Show how an H3 checkpoint splits across TP ranks.")
    ap.add_argument("checkpoint")
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--split", default=None, help="the ranks' shares, as the launcher's --split (e.g. 3:2; default even)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    try:
        plan = resolve_plan(CheckpointLayout.from_file(args.checkpoint), args.tp_size, parse_split(args.split, args.tp_size))
    except TP2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [
        dict(name=t.name, style=t.layer_style, kind=t.kind, dtype=t.dtype, full_shape=list(t.full_shape),
             local_shapes=[list(t.local_shape(r)) for r in range(plan.tp_size)])
        for t in plan.tensors.values()
    ]  # fmt: skip
    if args.json:
        head = {k: v for k, v in vars(plan).items() if k not in ("linears", "tensors", "head_bounds", "ffn_bounds")}
        print(json.dumps({**head, "fingerprint": plan.fingerprint(), "tensors": rows}, indent=1))
        return 0
    print(plan.summary())
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(
            f"{r['name']:<{width}}  {r['style']:<19} {r['kind']:<5} {r['dtype']:<4} {str(r['full_shape']):<16} -> {' | '.join(map(str, r['local_shapes']))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
