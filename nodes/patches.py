"""The pack's changes to ComfyUI, each named, installed once, listed: process-wide and per model.

    PATCHES.install(owner, attr, make)   owner.attr = make(original), once; the name is "<owner>.<attr>"
    PATCHES.names()                      what is installed, e.g. ["comfy.sd.load_diffusion_model", ...]
    changes_of(model).replace(name, obj, attr, make)   the same for one object of one model the pack built (a
                                         linear's or a block's forward, the text refiner); kept on the model

Every function the pack replaces in ComfyUI goes through PATCHES, every per-instance change through the model's
ModelChanges; `make` is always handed the original it replaces. The status node lists both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class ModelChanges:
    """The per-instance changes the pack made to one model's objects: obj.attr = make(what it was), each named.
    They live and go with the model; nothing puts them back."""

    def __init__(self):
        self._changes: dict[str, tuple[object, str]] = {}  # name -> (obj, attr)

    def replace(self, name: str, obj: object, attr: str, make: Callable[[object], object]) -> None:
        """obj.attr = make(obj.attr) under `name` (e.g. "blocks.3.attn.out_proj.forward"), unless already done."""
        if name not in self._changes:
            setattr(obj, attr, make(getattr(obj, attr)))
            self._changes[name] = (obj, attr)

    def summary(self) -> str:
        """What was changed, by kind: "forward of 4 Linear, preprocess_text_embeds of 1 MiniMaxH3Model"."""
        kinds = Counter(f"{attr} of {{}} {type(obj).__name__}" for obj, attr in self._changes.values())
        return ", ".join(kind.format(n) for kind, n in kinds.items()) or "nothing"


class PatchRegistry(ModelChanges):
    """Process-wide patches of ComfyUI's modules and classes, each named "<owner>.<attr>"."""

    def install(self, owner: object, attr: str, make: Callable[[object], object]) -> None:
        owner_name = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__  # a class, or a module
        self.replace(f"{owner_name}.{attr}", owner, attr, make)

    def names(self) -> list[str]:
        return list(self._changes)


PATCHES = PatchRegistry()


def changes_of(model: object) -> ModelChanges:
    """The ModelChanges kept on `model` (made on first use)."""
    return model.__dict__.setdefault("tp2_changes", ModelChanges())
