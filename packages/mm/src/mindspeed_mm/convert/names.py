"""The two names of each tensor of a vision-language model: the module name and the hub's file name.

The trainer (and its DCP checkpoints) see the model's module names
(``model.language_model.layers.0.self_attn.q_proj.weight``); a Hugging Face directory stores
the hub's names (Qwen2.5-VL: ``model.layers.0.self_attn.q_proj.weight``, ``visual.blocks.0...``).
transformers renames on load and reverts on ``save_pretrained``; :func:`model_names` asks it for
the same reversal, on a model built on the meta device from ``config.json`` (no weights read),
so the mapping is transformers' own. Tied tensors (``lm_head.weight`` with tied embeddings) are
in the model's state dict but not in the files.

A diffusers transformer (config.json with ``_class_name``) stores its state dict under its module
names in ``diffusion_pytorch_model.safetensors``: its two names are one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mindspeed_mm.models import family_of
from mindspeed_mm.models.dit import build_meta_dit, dit_family_of
from mindspeed_mm.models.loading import build_meta_model

#: The weight files' stem of a diffusers model directory.
DIFFUSERS_STEM = "diffusion_pytorch_model"


@dataclass(frozen=True)
class ModelNames:
    """The tensor names of one model.

    Attributes:
        architecture: the transformers class name.
        hub: module name -> name in a Hugging Face directory, for every tensor the files hold.
        tied: module name -> the module name whose tensor it shares (not in the files).
        shapes: module name -> shape, for every tensor of the state dict.
        stem: the safetensors files' name stem (``model``; diffusers: ``diffusion_pytorch_model``).
    """

    architecture: str
    hub: dict[str, str]
    tied: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    stem: str = "model"

    @property
    def is_diffusers(self) -> bool:
        """A diffusers model (its directory is written as diffusers writes it)."""
        return self.stem == DIFFUSERS_STEM

    def module_of(self) -> dict[str, str]:
        """Name in a file -> module name (the module names themselves are accepted too)."""
        out = {name: name for name in self.hub}
        out.update({hub: module for module, hub in self.hub.items()})
        return out


def model_names(path: str | Path) -> ModelNames:
    """The names of the model of the Hugging Face directory ``path`` (only its config.json is read).

    Raises:
        ValueError: no config.json, or an architecture that is not registered; or a family whose
            files fuse or split tensors (not a one-to-one renaming).
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if _is_diffusers(path):
        return dit_names(path)
    family = family_of(path)
    model = build_meta_model(path, family)
    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    by_id = {id(tensor): name for name, tensor in kept.items()}
    reverted = revert_weight_conversion(model, dict(kept))
    hub = {by_id.get(id(tensor)): name for name, tensor in reverted.items()}
    if None in hub or len(hub) != len(kept):
        raise ValueError(
            f"{family.architecture}: its Hugging Face files do not hold its tensors one to one (fused or "
            "split tensors); convert does not support it"
        )
    parameters = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
    tied = {name: parameters[id(model.get_parameter(name))] for name in state if name not in kept}
    return ModelNames(family.architecture, hub, tied, {name: tuple(t.shape) for name, t in state.items()})


def _is_diffusers(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    try:
        return config.is_file() and "_class_name" in json.loads(config.read_text())
    except ValueError:
        return False


def dit_names(path: str | Path) -> ModelNames:
    """The names of the diffusers transformer of ``path`` (its config.json's ``_class_name``; no weights read).

    Raises:
        ValueError: a class that is not a registered diffusion-transformer family.
    """
    family = dit_family_of(path)
    state = build_meta_dit(path, family).state_dict()
    return ModelNames(
        family.architecture,
        {name: name for name in state},
        {},
        {name: tuple(t.shape) for name, t in state.items()},
        DIFFUSERS_STEM,
    )
