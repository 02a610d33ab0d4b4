"""The pack's changes to ComfyUI, each named, installed once, listed: process-wide (removable) and per model.

    PATCHES.install(owner, attr, make)   owner.attr = make(original), once; the name is "<owner>.<attr>"
    PATCHES.remove_all()                 ComfyUI's originals back in place (refused if someone patched on top of ours)
    PATCHES.names()                      what is installed, e.g. ["comfy.sd.load_diffusion_model", ...]
    changes_of(model).replace(name, obj, attr, make)   the same for one object of one model the pack built (a
                                         linear's or a block's forward, the text refiner); kept on the model

Every function the pack replaces in ComfyUI goes through PATCHES (nodes/loader.py, lora.py, parallel.py,
interrupts.py, prompt_lifecycle.py, vae_decode.py), every per-instance change through the model's ModelChanges;
`make` is always handed the original it replaces. The status node lists both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    name: str
    owner: object
    attr: str
    original: object
    replacement: object


def _owner_name(owner: object) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", type(owner).__name__)


class PatchRegistry:
    """Process-wide patches of ComfyUI's modules and classes."""

    def __init__(self):
        self._patches: dict[str, Patch] = {}

    def install(self, owner: object, attr: str, make: Callable[[object], object]) -> Patch:
        """Replace owner.attr with make(original) unless this registry already did; returns the patch."""
        name = f"{_owner_name(owner)}.{attr}"
        if name in self._patches:
            return self._patches[name]
        original = getattr(owner, attr)
        patch = Patch(name, owner, attr, original, make(original))
        setattr(owner, attr, patch.replacement)
        self._patches[name] = patch
        return patch

    def remove_all(self) -> None:
        for name in reversed(list(self._patches)):
            patch = self._patches[name]
            current = getattr(patch.owner, patch.attr)
            if current is not patch.replacement:
                raise RuntimeError(
                    f"cannot remove the pack's patch of {name}: something else replaced it after the pack did ({current!r}); "
                    "remove that one first"
                )
            setattr(patch.owner, patch.attr, patch.original)
            del self._patches[name]

    def names(self) -> list[str]:
        return list(self._patches)

    def __repr__(self) -> str:
        return f"PatchRegistry({', '.join(self._patches) or 'nothing installed'})"


PATCHES = PatchRegistry()


class ModelChanges:
    """The per-instance changes the pack made to one model's objects: obj.attr = make(what it was), each named.
    They live and go with the model; nothing puts them back."""

    def __init__(self):
        self._changes: dict[str, tuple[object, str]] = {}  # name -> (obj, attr)

    def replace(self, name: str, obj: object, attr: str, make: Callable[[object], object]) -> None:
        """obj.attr = make(obj.attr) under `name` (e.g. "blocks.3.attn.out_proj.forward"), unless already done."""
        if name in self._changes:
            return
        setattr(obj, attr, make(getattr(obj, attr)))
        self._changes[name] = (obj, attr)

    def summary(self) -> str:
        """What was changed, by kind: "forward of 4 Linear, preprocess_text_embeds of 1 MiniMaxH3Model"."""
        kinds: dict[str, int] = {}
        for obj, attr in self._changes.values():
            kind = f"{attr} of {{}} {type(obj).__name__}"
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(kind.format(n) for kind, n in kinds.items()) or "nothing"

    def __repr__(self) -> str:
        return f"ModelChanges({self.summary()})"


CHANGES_ATTR = "tp2_changes"


def changes_of(model: object) -> ModelChanges:
    """The ModelChanges kept on `model` (made on first use)."""
    changes = model.__dict__.get(CHANGES_ATTR)
    if changes is None:
        changes = ModelChanges()
        model.__dict__[CHANGES_ATTR] = changes
    return changes
