"""TEST-ONLY: scripts/lib/balance.py or check.py with some ranks measured slower, for --split auto's tests.

    python tests/slowed_balance.py REPEATS SCRIPT ARGS...   e.g. 1,3 scripts/lib/balance.py 1 0 1: rank 1 slowed threefold
    slowed_python(folder, REPEATS)                          a `python` for the launcher ($PYTHON) that runs balance.py
                                                            and check.py so, anything else as the real Python does

Rank r's block is timed REPEATS[r] times in a row per measurement (1 where unlisted): it measures that much slower.
balance.block_timer is wrapped: on a GPU each rank gets its own timer (in rank order); on the CPU the ranks share one
and take turns, so measurement i is rank i mod tp_size's.
"""

from __future__ import annotations

import itertools
import os
import runpy
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slowed_python(folder, repeats: str) -> str:
    path = os.path.join(str(folder), "python-slowed")
    real, me = shlex.quote(sys.executable), shlex.quote(os.path.abspath(__file__))
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\ncase "$1" in */scripts/lib/balance.py|*/scripts/lib/check.py) exec {real} {me} {repeats} "$@";; esac\n')
        f.write(f'exec {real} "$@"\n')
    os.chmod(path, 0o755)
    return path


def main(repeats: str, script: str, *args: str) -> None:
    sys.path[:0] = [os.path.dirname(os.path.abspath(script)), ROOT]
    import balance  # the script's own folder: check.py imports this very module

    per_rank, tp_size = [int(n) for n in repeats.split(",")], []
    made, measure, created = balance.block_timer, balance.measure, itertools.count()

    def block_timer(device, shape):
        timer, rank, turns = made(device, shape), next(created), itertools.count()

        def slowed() -> float:
            r = next(turns) % tp_size[0] if device.type == "cpu" else rank
            return sum(timer() for _ in range(per_rank[r] if r < len(per_rank) else 1))

        return slowed

    def measuring(cpu, gpus):
        tp_size.append(len(gpus))
        return measure(cpu, gpus)

    balance.block_timer, balance.measure = block_timer, measuring
    sys.argv = [script, *args]
    if script.endswith("balance.py"):
        sys.exit(balance.main(list(args)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
