"""The launcher's split check (scripts/start-tp2.sh, before any rank starts): the check that
`python -m tp2.inspect CKPT --tp-size N [--split S]` makes (tp2.plan.resolve_plan on the file's header; H3 text
encoders by tp2.te_plan), over several files in one process, so torch is imported once.

    check_tp_size.py TP_SIZE SPLIT EXPLICIT FILE...

SPLIT: the launcher's --split ("" for even). EXPLICIT 1: the files were named (--ckpt), each must split; 0: a scan of
the model folders, where only MiniMax-H3 DiTs and text encoders count and, of each kind, one that splits is enough
(the others get a warning). Exit 0: fits (or nothing to judge); 2: refused, with each file's reason and what works on
stderr; 3: a file's check ran past CHECK_TIMEOUT_S (named on stderr). Run with the pack's folder on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
import threading

from tp2.checkpoint import CheckpointLayout, find_prefix
from tp2.errors import TP2Error
from tp2.plan import resolve_plan
from tp2.split import is_even, named, parse_split
from tp2.te_plan import is_h3_text_encoder, resolve_te_plan

CHECK_TIMEOUT_S = 60.0  # a header read takes well under a second: a check this long is stuck (a stalled mount, a bug)


def _watchdog(path: str) -> threading.Timer:
    """Started around one file's check: past CHECK_TIMEOUT_S it names the file and ends the process (exit 3)."""

    def expire() -> None:
        print(f"start-tp2: checking {path} took more than {CHECK_TIMEOUT_S:.0f} s: stopped", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(CHECK_TIMEOUT_S, expire)
    timer.daemon = True
    return timer


def judge(path: str, tp_size: int, shares, explicit: bool) -> tuple[str | None, str | None]:
    """(kind, why refused): kind "dit" or "encoder", None when the file is not H3's to judge."""
    try:
        layout = CheckpointLayout.from_file(path)
        kind = "encoder" if is_h3_text_encoder(layout) else "dit"
        if kind == "dit" and not explicit:
            find_prefix(layout)  # a scan judges MiniMax-H3 files only
    except Exception as e:  # a file this cannot read is no H3 checkpoint to judge (named with --ckpt: refused)
        return ("dit", str(e)) if explicit else (None, None)
    try:
        (resolve_te_plan if kind == "encoder" else resolve_plan)(layout, tp_size, shares)
        return kind, None
    except TP2Error as e:
        return kind, str(e)


def main(argv: list[str]) -> int:
    tp_size, explicit, paths = int(argv[0]), argv[2] == "1", argv[3:]
    try:
        shares = parse_split(argv[1], tp_size)
    except TP2Error as e:
        print(f"start-tp2: {e}", file=sys.stderr)
        return 2
    fits, refused = {"dit": [], "encoder": []}, {"dit": [], "encoder": []}
    for path in paths:
        watchdog = _watchdog(path)
        watchdog.start()
        kind, why = judge(path, tp_size, shares, explicit)
        watchdog.cancel()
        if kind:
            (refused[kind].append(f"{os.path.basename(path)}: {why}") if why else fits[kind].append(os.path.basename(path)))
    how = f"tp_size {tp_size}" + ("" if is_even(shares) else f", split {named(shares)}")
    if not any(fits.values()) and not any(refused.values()):
        print(f"{how}: none of the {len(paths)} file(s) found is a MiniMax-H3 model to check it against")
    rc = 0
    for kind in ("dit", "encoder"):
        if fits[kind]:
            print(f"{how}: fits {', '.join(fits[kind])} (checked as python -m tp2.inspect does)")
        for r in refused[kind]:
            if fits[kind]:
                print(f"start-tp2: WARNING: {r} Prompts that load that file will be refused.", file=sys.stderr)
            else:
                print(f"start-tp2: {r}", file=sys.stderr)
                rc = 2
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
