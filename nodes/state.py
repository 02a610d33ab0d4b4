"""This rank's TP state inside one ComfyUI process: the env, the session, the kernels, the loaded models, the prompt
it is executing. `STATE.env is None` means the pack is inactive (TP env vars unset) and must change nothing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from ..tp2 import settings

log = logging.getLogger("minimax_h3_tp2")


@dataclass
class LoadedModel:
    """What the loader learned about the H3 model it built for this rank."""

    source: str
    plan_summary: str
    plan_fingerprint: str
    checkpoint_fingerprint: str
    origin: str  # where its weights came from: "shard-on-read", "rank file ...", "rank cache ...", "mapped whole"
    load_seconds: float
    changes: object  # nodes.patches.ModelChanges: what the pack replaced on the model's objects
    split: str = "even"  # the split its plan really cut (tp2.split.cut_named), which may differ from the one asked for


@dataclass
class Prompt:
    """The prompt this ComfyUI is executing (the prompt worker runs one at a time); a fresh one as each starts."""

    prompt_id: str | None = None
    run: str | None = None  # the id every rank knows this execution by
    fingerprint: str = "none"
    details: str = "{}"  # tp2.handshake.prompt_details: what a mismatch message names
    model_calls: int = 0
    transformer_options: dict | None = None  # the last model evaluation's (its sigmas give the sampling step)
    coordinated_stop: bool = False  # rank 0 told every rank to stop at this model evaluation
    steps: dict[str, int] = field(default_factory=dict)  # steps of each kind so far (nodes/run.py step_key)
    split_decodes: int = 0  # video decodes split over the ranks so far (identical by construction)
    alone: bool = False  # a peer missed a step of this prompt: later decodes are not compared
    warnings: list[dict] = field(default_factory=list)  # nodes' warnings to the user, put in its history at the end


@dataclass
class RankState:
    env: settings.TPEnv | None = None
    session: object | None = None  # tp2.session.TPSession, created at activation
    device: object | None = None
    int8_gemm: object | None = None  # kernels.select_int8_gemm() result
    reduce_dtype: object = None  # torch dtype of the row-parallel all-reduce (TP2_REDUCE_DTYPE)
    shares: tuple[int, ...] | None = None  # TP2_SPLIT: each rank's share of the split layers (tp2/split.py)
    sampling_key: str = ""  # the sampling run every rank agreed on last (prompt id / sampler number)
    attention: str = "comfyui"  # resolved backend name, "comfyui" = ComfyUI's own choice
    compute_dtype: object = None  # torch dtype the DiT computes in (TP2_COMPUTE_DTYPE, set at load; nodes/loader.py)
    models: list[LoadedModel] = field(default_factory=list)
    prompt: Prompt = field(default_factory=Prompt)
    last_agreement: str = "none yet"
    numerics: str = "not run yet (runs at the first int8 H3 load)"  # tp2.numerics report of this device's int8 path
    boot_registered: threading.Event = field(default_factory=threading.Event)

    @property
    def active(self) -> bool:
        return self.env is not None

    @property
    def tag(self) -> str:
        return f"[tp2 r{self.env.tp_rank}/{self.env.tp_size}]" if self.env else "[tp2 off]"


STATE = RankState()
