"""The manifest: every model family of the suite by name, and the module that declares it.

One table for both kinds: vision-language models by their config's ``architectures`` name
(:class:`~mindspeed_mm.models.family.VLMFamily`), diffusion transformers by their config's
``_class_name`` (:class:`~mindspeed_mm.models.dit.DiTFamily`). A family module registers its family
when it is imported; the registries (:data:`~mindspeed_mm.models.family.FAMILIES`,
:data:`~mindspeed_mm.models.dit.DIT_FAMILIES`) import it by this table when its name is first
looked up, and every module of the table when all are listed or a name is unknown (so the error
lists them all). No other module imports a family for its side effect, and importing
``mindspeed_mm.models`` loads none. Adding a family is one module plus one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable, Iterator, Mapping
from typing import TypeVar

from mindspeed.registry import Registry

T = TypeVar("T")

#: ``architectures`` name -> the module declaring the vision-language family.
VLM_MODULES = {
    "Qwen2_5_VLForConditionalGeneration": "mindspeed_mm.models.qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "mindspeed_mm.models.qwen3_vl",
    "InternVLForConditionalGeneration": "mindspeed_mm.models.internvl",
    "Qwen2_5OmniThinkerForConditionalGeneration": "mindspeed_mm.models.qwen2_5_omni",
}
#: diffusers ``_class_name`` -> the module declaring the diffusion-transformer family.
DIT_MODULES = {
    "WanTransformer3DModel": "mindspeed_mm.models.wan",
    "WanTransformer3DModel:i2v": "mindspeed_mm.models.wan_i2v",
    "WanTransformer3DModel:ti2v": "mindspeed_mm.models.wan_ti2v",
    "WanTransformer3DModel:flf2v": "mindspeed_mm.models.wan_i2v",
    "FluxTransformer2DModel": "mindspeed_mm.models.flux",
    "SD3Transformer2DModel": "mindspeed_mm.models.sd3",
    "QwenImageTransformer2DModel": "mindspeed_mm.models.qwen_image",
    "QwenImageTransformer2DModel:edit": "mindspeed_mm.models.qwen_image_edit",
}


class ManifestRegistry(Registry[T]):
    """A :class:`~mindspeed.registry.Registry` whose entries are declared by modules named in a manifest.

    Looking a key up imports its module first (once); listing, counting or an unknown key imports
    them all. Families registered by other code (plugins, tests) work as in any registry.

    Args:
        kind: what is registered (used in error messages).
        modules: key -> the module that registers it when imported.
    """

    def __init__(self, kind: str, modules: Mapping[str, str]) -> None:
        super().__init__(kind)
        self.modules = dict(modules)

    def _load(self, key: Hashable | None = None) -> None:
        """Import the module of ``key`` (every module of the manifest when None or not in it)."""
        names = [self.modules[key]] if key in self.modules else list(self.modules.values())
        for name in names:
            importlib.import_module(name)
        if key in self.modules and not super().__contains__(key):
            raise RuntimeError(f"{self.modules[key]} registers no {self.kind} {key!r}; mend the manifest")

    def _ensure(self, key: Hashable | None = None) -> None:
        if key is None or not super().__contains__(key):
            self._load(key)

    def get(self, key: Hashable) -> T:
        """The entry under ``key``, its module imported first. Raises ValueError for an unknown key."""
        self._ensure(key)
        return super().get(key)

    def unregister(self, key: Hashable) -> T:
        """Remove and return the entry under ``key``."""
        self._ensure(key)
        return super().unregister(key)

    def keys(self) -> list[Hashable]:
        """Every key, the manifest's modules imported first."""
        self._ensure()
        return super().keys()

    def items(self) -> list[tuple[Hashable, T]]:
        """Every (key, entry) pair, the manifest's modules imported first."""
        self._ensure()
        return super().items()

    def __contains__(self, key: object) -> bool:
        self._ensure(key if isinstance(key, Hashable) else None)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Hashable]:
        self._ensure()
        return super().__iter__()

    def __len__(self) -> int:
        self._ensure()
        return super().__len__()
