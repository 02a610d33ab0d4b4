"""The one registry of the pack's process-wide changes to ComfyUI: each named, installed once, removable, listed.

    PATCHES.install(owner, attr, make)   owner.attr = make(original), once; the name is "<owner>.<attr>"
    PATCHES.remove(name) / remove_all()  ComfyUI's original back in place (refused if someone patched on top of ours)
    PATCHES.names()                      what is installed, e.g. ["comfy.sd.load_diffusion_model", ...]

Every function the pack replaces in ComfyUI goes through here (nodes/loader.py, lora.py, parallel.py, interrupts.py,
lockstep.py, vae_decode.py); the status node lists them. Per-model changes (a block's forward, a row-parallel
linear's forward, the text refiner) live on the model objects the pack built and go with them.
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

    def remove(self, name: str) -> None:
        patch = self._patches[name]
        current = getattr(patch.owner, patch.attr)
        if current is not patch.replacement:
            raise RuntimeError(
                f"cannot remove the pack's patch of {name}: something else replaced it after the pack did ({current!r}); "
                "remove that one first"
            )
        setattr(patch.owner, patch.attr, patch.original)
        del self._patches[name]

    def remove_all(self) -> None:
        for name in reversed(list(self._patches)):
            self.remove(name)

    def names(self) -> list[str]:
        return list(self._patches)

    def __repr__(self) -> str:
        return f"PatchRegistry({', '.join(self._patches) or 'nothing installed'})"


PATCHES = PatchRegistry()
