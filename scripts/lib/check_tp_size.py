"""The launcher's tp_size check (scripts/start-tp2.sh, before any rank starts): the check that
`python -m tp2.inspect CKPT --tp-size N` makes (tp2.plan.resolve_plan on the file's header), over several files in
one process, so torch is imported once.

    check_tp_size.py TP_SIZE EXPLICIT FILE...

EXPLICIT 1: the files were named (--ckpt), each must split; 0: a scan of models/diffusion_models, where only
MiniMax-H3 files count and one that splits is enough (the others get a warning). Exit 0: fits (or nothing to judge);
2: refused, with each file's reason and the tp_sizes that work on stderr. Run with the pack's folder on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys

from tp2.checkpoint import CheckpointLayout
from tp2.errors import TP2Error
from tp2.h3_layout import find_prefix
from tp2.plan import resolve_plan

tp_size, explicit, paths = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
fits, refused = [], []
for path in paths:
    name = os.path.basename(path)
    try:
        layout = CheckpointLayout.from_file(path)
        if not explicit:
            find_prefix(layout)  # a scan judges MiniMax-H3 files only
    except Exception as e:  # a file this cannot read is no H3 checkpoint to judge (named with --ckpt: refused)
        if explicit:
            refused.append(f"{name}: {e}")
        continue
    try:
        resolve_plan(layout, tp_size)
        fits.append(name)
    except TP2Error as e:
        refused.append(f"{name}: {e}")
if fits:
    print(f"tp_size {tp_size}: fits {', '.join(fits)} (checked as python -m tp2.inspect does)")
    for r in refused:
        print(f"start-tp2: WARNING: {r} Prompts that load that file will be refused.", file=sys.stderr)
elif refused:
    for r in refused:
        print(f"start-tp2: {r}", file=sys.stderr)
    sys.exit(2)
else:
    print(f"tp_size {tp_size}: none of the {len(paths)} checkpoint(s) found is a MiniMax-H3 model to check it against")
