"""Every rank runs the vision tower in every microbatch, so FSDP2's collectives match across ranks.

A microbatch without images skips the vision tower inside the Hugging Face forward; under
FSDP2 the ranks whose microbatch has images would then wait in the tower's all-gathers (and
reduce-scatters in the backward) for a rank that never comes. A forward pre-hook on the
language model runs the model's ``get_image_features`` (tower and projector) on the family's
smallest dummy input when the microbatch has
no images (the same place in the order of collectives as the real call, which precedes the
language model) and adds ``0 x`` its output to the language model's input embeddings, so the
backward passes through the tower too. The loss and the gradients are unchanged.

When the data holds videos (:attr:`VisionSync.videos`) and the family encodes them in a call of
their own (Qwen-VL's ``get_video_features``), a microbatch without a video runs that on the
family's dummy video too, so every rank makes two tower calls per microbatch.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_mm.models.family import VLMFamily


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (DeepStack feature lists included), so every parameter used gets a gradient."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):  # transformers' ModelOutput is a dict
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class VisionSync:
    """The pre-hook; set :attr:`needed` before each microbatch's forward.

    Args:
        model: the (sharded) model.
        family: its family (module names and dummy input).
    """

    def __init__(self, model: torch.nn.Module, family: VLMFamily) -> None:
        self.image_features = model.model.get_image_features  # the model's own image path (tower and projector)
        self.inputs = family.dummy_vision_inputs(model.config)
        self.video_inputs = family.dummy_video_inputs(model.config) if family.dummy_video_inputs else None
        self.video_features = getattr(model.model, "get_video_features", None)
        self.needed = False
        self.videos = False
        self.needed_video = False
        language = model.get_submodule(family.language_module)
        self.handle = language.register_forward_pre_hook(self._hook, with_kwargs=True)

    def begin(self, vision: dict[str, torch.Tensor]) -> None:
        """Note which tower calls the next microbatch (its vision inputs) lacks."""
        self.needed = "pixel_values" not in vision
        self.needed_video = self.videos and self.video_inputs is not None and "pixel_values_videos" not in vision

    def _hook(
        self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        if not (self.needed or self.needed_video) or kwargs.get("inputs_embeds") is None:
            return None
        embeds = kwargs["inputs_embeds"]
        outputs = []
        if self.needed:
            outputs.append(self.image_features(**{k: v.to(embeds.device) for k, v in self.inputs.items()}))
        if self.needed_video:
            outputs.append(self.video_features(**{k: v.to(embeds.device) for k, v in self.video_inputs.items()}))
        zero = sum(t.float().sum() for t in _tensors(outputs)) * 0.0
        return args, {**kwargs, "inputs_embeds": embeds + zero.to(embeds.dtype)}

    def remove(self) -> None:
        """Remove the hook."""
        self.handle.remove()
