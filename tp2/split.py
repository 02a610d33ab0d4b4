"""Each rank's share of the split layers (`--split 3:2`, TP2_SPLIT), and a width cut by the shares.

An even split cuts a width into equal slices, or refuses it (`resolved` says which tp_sizes work). Uneven shares give
each rank whole `unit`s (a ConvRot group, a pair of heads, a KV head) in proportion, rounded by largest remainder; a
rank left without one is refused. Imports nothing from `comfy`.
"""

from __future__ import annotations

import math

from .errors import PlanError

Shares = tuple[int, ...]


def even(tp_size: int) -> Shares:
    return (1,) * tp_size


def is_even(shares: Shares) -> bool:
    return len(set(shares)) == 1


def reduced(shares: Shares) -> Shares:
    g = math.gcd(*shares)
    return tuple(s // g for s in shares)


def named(shares: Shares) -> str:
    return "even" if is_even(shares) else ":".join(map(str, reduced(shares)))


def join_or(values: list[int]) -> str:
    """ "2", "2 or 4", "1, 2 or 4"."""
    s = [str(v) for v in values]
    return s[0] if len(s) == 1 else ", ".join(s[:-1]) + " or " + s[-1]


def per_rank(widths: list[int]) -> str:
    """ "28/rank" for equal widths, else "32+24" (rank 0 first)."""
    return f"{widths[0]}/rank" if len(set(widths)) == 1 else "+".join(map(str, widths))


def cut_named(shares: Shares, widths: list[int]) -> str:
    """The split a model was cut by, given the ranks' widths of its heads: an uneven split of a model with too few
    whole units comes out even, and says so ("even (3:1 asked: too few units)")."""
    return f"even ({named(shares)} asked: too few units)" if not is_even(shares) and is_even(tuple(widths)) else named(shares)


def parse_split(text: str | None, tp_size: int) -> Shares:
    """The shares of `text` ("3:2", one positive integer per rank, rank 0 first); empty or None: the even split."""
    if not text:
        return even(tp_size)
    parts = text.split(":")
    if len(parts) != tp_size or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PlanError(
            f"split '{text}' is not {tp_size} positive whole numbers joined by ':' (one per rank, rank 0 first), "
            f"e.g. {':'.join(['3'] + ['2'] * (tp_size - 1))}; leave it out for an even split."
        )
    return tuple(int(p) for p in parts)


def small(shares: Shares, per_rank: int = 4) -> Shares:
    """`shares` in small whole numbers (summing to about `per_rank` x tp_size, each at least 1; even: all 1)."""
    return reduced(tuple(max(1, c) for c in counts(per_rank * len(shares), shares)))


def counts(n_units: int, shares: Shares) -> list[int]:
    """`n_units` whole units dealt in proportion to `shares`, by largest remainder (ties to the lower rank)."""
    total = sum(shares)
    out = [n_units * s // total for s in shares]
    order = sorted(range(len(shares)), key=lambda r: (-(n_units * shares[r] % total), r))
    for r in order[: n_units - sum(out)]:
        out[r] += 1
    return out


def cut(total: int, unit: int, shares: Shares) -> tuple[int, ...] | None:
    """Bounds (0, b1, ..., total) of each rank's slice of a width `total`; None when it cannot be cut: not evenly
    (even shares), or not into whole `unit`s with at least one per rank (uneven shares)."""
    n = len(shares)
    if is_even(shares):
        sizes = [total // n] * n if total % n == 0 else None
    else:
        sizes = [c * unit for c in counts(total // unit, shares)] if total % unit == 0 else None
    if not sizes or min(sizes) < 1:
        return None
    return tuple(sum(sizes[:r]) for r in range(n + 1))


def scaled(bounds: tuple[int, ...] | None, total: int, length: int) -> tuple[int, ...] | None:
    """Bounds cut from a width of `total` applied to a tensor dim of `length` (a multiple or a whole fraction of it:
    head_dim rows per head, two nvfp4 codes a byte); None when a bound would fall inside an element."""
    if bounds is None or any(b * length % total for b in bounds):
        return None
    return tuple(b * length // total for b in bounds)


def refusal(shares: Shares, what: str, total: int, unit: int) -> str:
    """Why uneven `shares` cannot cut `what` (a width of `total`) into whole `unit`s, and the nearest split that can."""
    n, ranks = total // unit, len(shares)
    said = f"The split {named(shares)} leaves a rank no whole unit of the {what} ({total} = {n} units of {unit})."
    if n < ranks:
        return f"{said} No uneven split of {ranks} ranks can: leave --split out (the even split), or use at most {n} rank(s)."
    return f"{said} The nearest split that works is {named(workable(n, shares))}."


def workable(n_units: int, shares: Shares) -> Shares:
    """The nearest shares that leave every rank at least one of `n_units` units (refused when there are fewer than ranks)."""
    if n_units < len(shares):
        raise PlanError(f"{n_units} whole unit(s) cannot give each of {len(shares)} ranks one: use at most {n_units} rank(s).")
    got = counts(n_units, shares)
    while min(got) < 1:
        got[got.index(max(got))] -= 1
        got[got.index(min(got))] += 1
    return reduced(tuple(got))


def resolved(resolve, layout, tp_size: int, shares: Shares | None, sizes):
    """`resolve(layout, tp_size, shares)`'s plan, or PlanError with its first problem and, for an even split, the
    tp_sizes among `sizes` that would work."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}. Use the number of GPUs (ranks), e.g. 2.")
    if shares is not None and len(shares) != tp_size:
        raise PlanError(f"The split {':'.join(map(str, shares))} names {len(shares)} shares for tp_size={tp_size}: give one per rank.")
    plan, problems = resolve(layout, tp_size, shares or even(tp_size))
    if problems:
        allowed = [n for n in sizes if not resolve(layout, n, even(n))[1]] if shares is None or is_even(shares) else []
        raise PlanError(problems[0] + (f" Use tp_size {join_or(allowed)}." if allowed else ""))
    return plan
