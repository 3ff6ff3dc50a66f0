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

When the data holds audio (:attr:`VisionSync.audio`; Qwen2.5-Omni), a microbatch without a clip
runs the model's ``get_audio_features`` on the family's dummy clip in a pre-hook on the model
itself, where the real audio call is (the first encoder call of the thinker's forward), and its
``0 x`` output joins the language model's input embeddings with the vision dummies'.
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
        # the model's own image path (tower and projector): on the inner model (Qwen-VL, InternVL) or on the
        # model itself (Qwen2.5-Omni's thinker, whose ``model`` is the text model)
        owner = model.model if hasattr(model.model, "get_image_features") else model
        self.image_features = owner.get_image_features
        self.inputs = family.dummy_vision_inputs(model.config)
        self.video_inputs = family.dummy_video_inputs(model.config) if family.dummy_video_inputs else None
        self.video_features = getattr(owner, "get_video_features", None)
        self.audio_features = getattr(model, "get_audio_features", None) if family.audio_inputs else None
        self.audio_inputs = family.dummy_audio_inputs(model.config) if family.dummy_audio_inputs else None
        self.audio = False
        self.needed_audio = False
        self.audio_zero: torch.Tensor | None = None
        self.needed = False
        self.videos = False
        self.needed_video = False
        language = model.get_submodule(family.language_module)
        self.handle = language.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.audio_handle = (
            model.register_forward_pre_hook(self._audio_hook, with_kwargs=True)
            if self.audio_features is not None
            else None
        )

    def begin(self, vision: dict[str, torch.Tensor]) -> None:
        """Note which tower calls the next microbatch (its vision inputs) lacks."""
        self.needed = "pixel_values" not in vision
        self.needed_video = self.videos and self.video_inputs is not None and "pixel_values_videos" not in vision
        self.needed_audio = self.audio and self.audio_inputs is not None and "input_features" not in vision
        self.audio_zero = None

    def _audio_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.needed_audio:
            return None
        given = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        device = given.device if given is not None else self.audio_inputs["input_features"].device
        out = self.audio_features(**{k: v.to(device) for k, v in self.audio_inputs.items()})
        self.audio_zero = sum(t.float().sum() for t in _tensors(out)) * 0.0
        return None

    def _hook(
        self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        if not (self.needed or self.needed_video or self.audio_zero is not None) or kwargs.get("inputs_embeds") is None:
            return None
        embeds = kwargs["inputs_embeds"]
        outputs = [] if self.audio_zero is None else [self.audio_zero]
        self.audio_zero = None
        if self.needed:
            outputs.append(self.image_features(**{k: v.to(embeds.device) for k, v in self.inputs.items()}))
        if self.needed_video:
            outputs.append(self.video_features(**{k: v.to(embeds.device) for k, v in self.video_inputs.items()}))
        zero = sum(t.float().sum() for t in _tensors(outputs)) * 0.0
        return args, {**kwargs, "inputs_embeds": embeds + zero.to(embeds.dtype)}

    def remove(self) -> None:
        """Remove the hook."""
        self.handle.remove()
        if self.audio_handle is not None:
            self.audio_handle.remove()
