"""Every environment variable the pack reads or sets, in one place: named, typed, defaulted, documented.

`freeze()` reads every setting once as a rank starts and `value(name)` answers from that snapshot; SETTINGS names each
(kind, default, meaning, whether the launcher exports it). Every other module asks here; none reads `os.environ`
(CUDA_VISIBLE_DEVICES and PYTORCH_CUDA_ALLOC_CONF are read here, never set). docs/SETTINGS.md is generated
(`python -m tp2.settings`); it and the launcher's defaults are checked against SETTINGS by tests/unit/test_settings.py.
Imports nothing from `comfy`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .errors import TP2Error


class SettingError(TP2Error, ValueError):
    """An environment variable holds a value the pack cannot use."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # bool | int | float | choice | text | path | list
    default: str | None  # as the environment would hold it; None: unset means "off"/"none"
    means: str  # what it does (for the error message)
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    launcher: bool = False  # scripts/start-tp2.sh exports it with this default
    shown: str | None = None  # the default as docs/SETTINGS.md states it, where it is worked out (not a fixed value)


# fmt: off
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("TP2_RANK", "int", None, "this process's rank, 0-based (set by the launcher)", low=0),
    Setting("TP2_WORLD_SIZE", "int", None, "the number of ranks (set by the launcher)", low=1),
    Setting("MASTER_ADDR", "text", "127.0.0.1", "where rank 0's rendezvous store listens"),
    Setting("MASTER_PORT", "int", "29511", "the rendezvous store's port", low=1, high=65535, shown="a free port"),
    Setting("TP2_SPLIT", "text", None, "each rank's share of the split layers, rank 0 first, e.g. 3:2 (unset: even; set by the "
            "launcher's --split)"),
    Setting("TP2_TIMEOUT_S", "float", "300", "seconds any collective waits for a peer", low=1e-9, launcher=True),
    Setting("TP2_PROMPT_TIMEOUT_S", "float", "45", "seconds ranks wait for each other at a sampler", low=1e-9, launcher=True),
    Setting("TP2_STALL_S", "float", None, "seconds a rank waits on a peer alive but not progressing, then the prompt fails", low=1e-9,
            shown="8x the run's slowest unit, at least 60 (between steps: TP2_TIMEOUT_S)"),
    Setting("TP2_INT8_KERNEL", "choice", "auto", "the row-parallel int8 GEMM", ("auto", "cuda", "triton", "eager"), launcher=True),
    Setting("TP2_ATTN_BACKEND", "choice", "auto", "the attention backend", ("auto", "ck", "sdpa"), launcher=True),
    Setting("TP2_COMPUTE_DTYPE", "choice", "auto", "the DiT's compute dtype (auto: fp32 below compute capability 8.0, else bf16)",
            ("auto", "fp32", "bf16")),
    Setting("TP2_REDUCE_DTYPE", "choice", "fp32", "the dtype of row-parallel partial sums, and of the exact wire's reduce", ("fp32", "bf16"),
            launcher=True),
    Setting("TP2_WIRE", "choice", "exact", "what the DiT's int8 row-parallel reduce sends: exact (the partial sums) or int8 "
            "(quantised in groups of a row; 2 ranks)", ("exact", "int8"), shown="the launcher's pick for the link (`exact` without it)"),
    Setting("TP2_SEQUENCE_PARALLEL", "bool", "0", "DiT blocks split the token rows over the ranks", launcher=True),
    Setting("TP2_SP_INT8_GATHER", "bool", "1", "int8 linears' inputs are gathered quantised", launcher=True),
    Setting("TP2_SP_FUSED_NORM", "bool", "0", "norm + modulation (+ gated residual) as one kernel on CUDA", launcher=True),
    Setting("TP2_OVERLAP", "int", None, "chunks of rows whose row-parallel reduce runs while the next chunk computes (0 or 1: off; "
            "int8 layers, 2 ranks)", low=0, shown="4 where the ranks reduce through NCCL, else off"),
    Setting("TP2_SP_CHUNK_ROWS", "int", "16384", "rows per chunk of the MLP at long sequences", low=2),
    Setting("TP2_PARALLEL_VAE", "bool", "1", "the H3 video VAE decode is split over the ranks", launcher=True),
    Setting("TP2_SECRET_FILE", "path", None, "the per-run secret of the front door", shown="RUN_DIR/secret"),
    Setting("TP2_RANK_URLS", "list", None, "every rank's HTTP address, rank 0 first (set by the launcher)"),
    Setting("TP2_CACHE_DIR", "path", None, "the rank cache, and the record of its files checked", shown="~/.cache/minimax-h3-tp2"),
    Setting("TP2_RANK_CACHE", "choice", "auto", "a rank's slices cut once to disk, then mapped (auto: cut with dynamic VRAM, use files "
            "already cut)", ("auto", "on", "off")),
    Setting("TP2_BLOCK_MS", "list", None, "each rank's H3 block, ms (`start-tp2.sh check` prints it): predicts the speed-up"),
    Setting("TP2_MAX_RESTARTS", "int", "5", "launcher: restarts in a row of a rank whose process ended", low=0, launcher=True),
    Setting("TP2_START_TIMEOUT_S", "float", "300", "launcher: seconds to wait for every rank's HTTP API", low=1e-9, launcher=True),
)}
# fmt: on
_TRUE, _FALSE = ("1", "on", "true"), ("0", "off", "false")


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable as set (stripped), or the setting's default."""
    got = _env(environ).get(name)
    return SETTINGS[name].default if got is None else got.strip()


_FROZEN: Mapping[str, object] | None = None


def freeze(environ: Mapping[str, str] | None = None) -> Mapping[str, object]:
    """Read every setting once, refusing a bad value now rather than mid-prompt, and answer `value(name)` from this
    snapshot from then on: a rank's settings cannot change under it (a rank calls this as it activates)."""
    global _FROZEN
    _FROZEN = MappingProxyType({name: _parse(name, environ) for name in SETTINGS})
    return _FROZEN


def value(name: str, environ: Mapping[str, str] | None = None):
    """The typed value: bool, int, float, the choice (lower case), text, a path, a list of strings, or None. From
    the frozen snapshot once there is one, unless `environ` is given."""
    if environ is None and _FROZEN is not None:
        return _FROZEN[name]
    return _parse(name, environ)


def _parse(name: str, environ: Mapping[str, str] | None):
    s = SETTINGS[name]
    text = raw(name, environ)
    if text is None or (text == "" and s.kind in ("path", "list")):
        return [] if s.kind == "list" else None
    if s.kind == "bool":
        if text.lower() not in _TRUE + _FALSE:
            raise SettingError(f"{name}={text!r} must be 1 ({s.means}) or 0 (not).")
        return text.lower() in _TRUE
    if s.kind == "choice":
        if text.lower() not in s.choices:
            raise SettingError(f"{name}={text!r} is not one of {', '.join(s.choices)} ({s.means}). Unset it for {s.default}.")
        return text.lower()
    if s.kind in ("int", "float"):
        try:
            number = int(text) if s.kind == "int" else float(text)
        except ValueError as e:
            raise SettingError(f"{name}={text!r} must be a {'whole ' if s.kind == 'int' else ''}number ({s.means}).") from e
        if (s.low is not None and number < s.low) or (s.high is not None and number > s.high):
            span = f"at least {s.low:g}" if s.high is None else f"from {s.low:g} to {s.high:g}"
            raise SettingError(f"{name}={number} must be {span} ({s.means}).")
        return number
    if s.kind == "list":
        return [part for part in text.split(",") if part]
    return text


@dataclass(frozen=True)
class TPEnv:
    """What the environment says about this rank (read before anything distributed starts)."""

    tp_rank: int
    tp_size: int
    master_addr: str
    master_port: int
    timeout_s: float


def read_tp_env(environ: Mapping[str, str] | None = None) -> TPEnv | None:
    """The TP settings from env, or None when TP2_RANK and TP2_WORLD_SIZE are both unset (pack inactive)."""
    env = _env(environ)
    if "TP2_RANK" not in env and "TP2_WORLD_SIZE" not in env:
        return None
    missing = [n for n in ("TP2_RANK", "TP2_WORLD_SIZE") if n not in env]
    if missing:
        raise SettingError(f"{missing[0]} is not set but the other TP variable is. Set both TP2_RANK and TP2_WORLD_SIZE, or neither.")
    tp_rank, tp_size = value("TP2_RANK", env), value("TP2_WORLD_SIZE", env)
    if not 0 <= tp_rank < tp_size:
        raise SettingError(f"TP2_RANK={tp_rank} must be in 0..{tp_size - 1} for TP2_WORLD_SIZE={tp_size}.")
    wire = value("TP2_WIRE", env)
    if wire != "exact" and tp_size != 2:  # tp2/wire.py's one-shot exchange saves bytes only at two ranks
        raise SettingError(f"TP2_WIRE={wire} needs exactly 2 ranks (TP2_WORLD_SIZE={tp_size}). Unset it.")
    return TPEnv(tp_rank, tp_size, raw("MASTER_ADDR", env), value("MASTER_PORT", env), value("TP2_TIMEOUT_S", env))


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """TP2_CACHE_DIR, else $XDG_CACHE_HOME/minimax-h3-tp2, else ~/.cache/minimax-h3-tp2."""
    env = _env(environ)
    return value("TP2_CACHE_DIR", env) or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minimax-h3-tp2")


def visible_gpus(environ: Mapping[str, str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES ("" unset): the launcher gives each rank its GPU's index, which names the ranks' link."""
    return _env(environ).get("CUDA_VISIBLE_DEVICES", "")


def torch_allocator_conf(environ: Mapping[str, str] | None = None) -> str:
    """PYTORCH_CUDA_ALLOC_CONF as torch reads it at start ("" unset): the capacity check names the allocator by it."""
    return _env(environ).get("PYTORCH_CUDA_ALLOC_CONF", "")


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def set_for_libraries(cuda: bool, loopback: bool, environ: dict | None = None) -> str | None:
    """Set what the pack needs from PyTorch and gloo before a process group forms; returns the NCCL error handling
    value replaced, if any.

    Under NCCL (`cuda`), TORCH_NCCL_ASYNC_ERROR_HANDLING=0: with 1 or 3 (3 is PyTorch's default) the NCCL watchdog
    ends the whole process when a collective times out or fails, i.e. a rank would die because its peer failed; the
    pack aborts communicators itself. On `loopback`, GLOO_SOCKET_IFNAME=lo unless set: gloo's own listeners stay on
    loopback (its default is the hostname's address)."""
    env = os.environ if environ is None else environ
    replaced = None
    if cuda:
        old = env.get(NCCL_ERROR_HANDLING)
        env[NCCL_ERROR_HANDLING] = "0"
        replaced = old if old not in (None, "0") else None
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return replaced


def markdown() -> str:
    """docs/SETTINGS.md: every setting with its kind, default and meaning."""
    table = ["| Variable | Kind | Default | What it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        kind = f"{s.kind}: {' / '.join(s.choices)}" if s.choices else s.kind
        default = s.shown or (f"`{s.default}`" if s.default is not None else "unset")
        table.append(f"| `{s.name}` | {kind} | {default} | {s.means} |")

    intro = (
        "Environment variables the pack reads (ComfyUI refuses unknown command-line flags). Generated from\n"
        "`tp2/settings.py` by `python -m tp2.settings > docs/SETTINGS.md`; a test checks it is current."
    )
    sections = ["# Settings", intro, "\n".join(table)]
    return "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
