"""What a vision-language family declares, and the registry of families by ``architectures``.

A family is the one description of a transformers VLM class that the suite needs: the module
prefixes of its parts (what ``model.freeze`` names), its default FSDP2 wrapping plan, its
placeholder and special tokens, how its multimodal rotary positions are computed for one
sample, and how to write its tiny test model. Every other view (loading, freezing, sharding,
packing) is derived from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.manifest import VLM_MODULES, ManifestRegistry


@dataclass(frozen=True)
class VLMFamily:
    """One transformers vision-language model class.

    Attributes:
        architecture: the ``architectures`` entry of its config.json.
        model_class: the transformers class, as ``module:Name`` (imported when used).
        parts: part name -> module-name prefixes (``vision_tower``, ``projector``, ``language_model``).
        fsdp_plan: module-name patterns wrapped as FSDP2 units (innermost first; ``{*}`` matches one name part).
        image_placeholder: what replaces ``<image>`` in a message before the chat template.
        image_token: the token that the placeholder holds once per image feature.
        image_inputs: ``(image processor output, image processor) -> (vision inputs of the model's
            forward, image tokens per image)``.
        positions: ``(model, encoded sample) -> position_ids`` of one sample whose first row is the
            text position (0 .. L-1), so packed samples restart there: ``[4, 1, L]`` for M-RoPE
            (text row, then the model's own three axes), ``[1, L]`` for 1-D positions.
        write_tiny: ``(directory, seed) -> None`` writes a tiny model of the family (config,
            random weights, tokenizer, image processor, chat template).
        language_module: the language model's module name (ranks whose microbatch has no image run
            ``model.model.get_image_features`` on a dummy input before it, so every rank joins the
            vision tower's FSDP2 collectives).
        dummy_vision_inputs: ``model config -> kwargs`` of ``get_image_features`` for the smallest image.
        processor_overrides: ``(min_pixels, max_pixels) -> kwargs`` for the image processor
            (Qwen-VL: the pixel bounds; default none, e.g. fixed-size tiles).
        vision_module: the vision encoder's module name, whose input rows (``pixel_values``, and
            ``grid_thw`` where it takes one) a Ulysses group shares out image by image and video
            frame by frame (:mod:`mindspeed_mm.trainer.vision_balance`); empty: every rank
            encodes every image.
        video_placeholder: what replaces ``<video>`` in a message before the chat template (empty:
            the family takes no videos).
        video_token: the token of that placeholder that :attr:`video_inputs` expands.
        video_inputs: ``(video processor output, video processor) -> (vision inputs of the model's
            forward, the text that replaces the video token, per video)``, as the family's
            transformers processor builds them (``replace_video_token``).
        dummy_video_inputs: ``model config -> kwargs`` of ``get_video_features`` for the smallest
            video (a rank without a video in its microbatch runs it when the data holds videos).
        audio_placeholder: what replaces ``<audio>`` in a message before the chat template (empty:
            the family takes no audio).
        audio_token: the token of that placeholder that :attr:`audio_inputs` expands.
        audio_inputs: ``feature extractor output -> (audio inputs of the model's forward, audio tokens
            per clip)``, as the family's transformers processor counts them.
        dummy_audio_inputs: ``model config -> kwargs`` of ``get_audio_features`` for the shortest clip
            (a rank without audio in its microbatch runs it when the data holds audio).
        encoders: input kind (``image``, ``video``, ``audio``) -> the module-name prefixes its encoder
            call runs (tower, projector, mergers): exactly the parameters that get no gradient in a
            step without that input on one rank; the FSDP2 trainer drops the gradients of zeros the
            dummy calls give them (:meth:`~mindspeed_mm.trainer.vlm_task.VLMTask.finish_gradients`).
    """

    architecture: str
    model_class: str
    parts: dict[str, tuple[str, ...]]
    fsdp_plan: tuple[str, ...]
    image_placeholder: str
    image_token: str
    image_inputs: Callable[[Any, Any], tuple[dict[str, torch.Tensor], list[int]]]
    positions: Callable[[Any, Any], torch.Tensor]
    write_tiny: Callable[[Path, int], None]
    language_module: str
    dummy_vision_inputs: Callable[[Any], dict[str, torch.Tensor]]
    processor_overrides: Callable[[int, int], dict[str, Any]] = lambda min_pixels, max_pixels: {}
    vision_module: str = ""
    video_placeholder: str = ""
    video_token: str = ""
    video_inputs: Callable[[Any, Any], tuple[dict[str, torch.Tensor], list[str]]] | None = None
    dummy_video_inputs: Callable[[Any], dict[str, torch.Tensor]] | None = None
    audio_placeholder: str = ""
    audio_token: str = ""
    audio_inputs: Callable[[Any], tuple[dict[str, torch.Tensor], list[int]]] | None = None
    dummy_audio_inputs: Callable[[Any], dict[str, torch.Tensor]] | None = None
    encoders: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def load_class(self) -> type:
        """The transformers model class."""
        import importlib

        module, name = self.model_class.split(":")
        return getattr(importlib.import_module(module), name)


#: ``architectures`` name -> family (each family's module imported when its name is first looked up).
FAMILIES: ManifestRegistry[VLMFamily] = ManifestRegistry("vision-language model family", VLM_MODULES)


def register_family(family: VLMFamily) -> VLMFamily:
    """Add ``family`` to :data:`FAMILIES` under its architecture name."""
    FAMILIES.register(family.architecture, family)
    return family


def family_of(path: str | Path) -> VLMFamily:
    """The family of the Hugging Face directory ``path``, from its config.json's ``architectures``.

    Raises:
        ValueError: no config.json, no ``architectures``, or an architecture not registered.
    """
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"{str(path)!r} has no config.json; give a local Hugging Face model directory")
    architectures = json.loads(config.read_text()).get("architectures") or []
    if not architectures:
        raise ValueError(
            f'{config} has no `architectures`; add the model class name, e.g. ["Qwen2_5_VLForConditionalGeneration"]'
        )
    return FAMILIES.get(architectures[0])
