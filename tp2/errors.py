"""The pack's exceptions: every message says what failed, on which object, with the numbers, and what to do.
Imports nothing from the pack or from `comfy`. Each class reports its module as `minimax_h3_tp2` (see the end)."""


class TP2Error(Exception):
    """Base class: anything the TP pack refuses or cannot do."""


class CheckpointFormatError(TP2Error):
    """The file is not a readable safetensors checkpoint."""


class PlanError(TP2Error):
    """The checkpoint cannot be split as asked (not H3, indivisible shapes, unknown tensors or quant formats)."""


class UnknownPrefixError(PlanError):
    """An H3 DiT under a key prefix the pack does not resolve: refused, never run unsplit on every rank."""


class ShardMismatchError(TP2Error):
    """A pre-sharded rank file belongs to another rank, tp_size, plan or source checkpoint."""


class RankMismatchError(TP2Error):
    """Ranks disagree on something they must share (pack version, plan, checkpoint, tp_size, prompt)."""


class PeerLostError(TP2Error):
    """A peer rank died, never arrived, or stopped answering within the timeout."""


class PromptAbortedError(TP2Error):
    """A rank cancelled the prompt while the ranks were meeting (interrupt, or a follower that is down)."""


class MissingRoleError(TP2Error):
    """An int8 or sharded linear ran inside a TP model without a colwise/rowwise role."""


class AdapterPlacementError(TP2Error):
    """A LoRA (or other weight patch) cannot be applied to this rank's shard as given."""


class NumericsError(TP2Error):
    """This device's int8 path measured wrong against exact math (tp2/numerics.py): the video would be noise."""


# ComfyUI shows an error as `<class module>.<class name>`; inside ComfyUI this module's name is the pack's folder path
# (`/.../custom_nodes/minimax-h3-tp2.tp2.errors`). The pack's name reads better in the UI and in tp2-submit.
for _cls in [c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, TP2Error)]:
    _cls.__module__ = "minimax_h3_tp2"
