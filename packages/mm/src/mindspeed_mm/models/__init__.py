"""Model families: vision-language models (transformers) and diffusion transformers (diffusers), by name.

Each family module declares one family: a :class:`~mindspeed_mm.models.family.VLMFamily` (how its
parts are named, its FSDP2 plan, its multimodal positions, its tiny test model) or a
:class:`~mindspeed_mm.models.dit.DiTFamily` (its FSDP2 plan, latents, inputs, sampling defaults,
sequence-parallel plan). The manifest (:mod:`~mindspeed_mm.models.manifest`) names them all; the
registries import a family's module when its name is first looked up, so importing this package
registers nothing by itself.
"""

from mindspeed_mm.models.family import FAMILIES, VLMFamily, family_of
from mindspeed_mm.models.loading import (
    freeze_parts,
    load_audio_processor,
    load_model,
    load_processing,
    load_video_processor,
)

__all__ = [
    "FAMILIES",
    "VLMFamily",
    "family_of",
    "freeze_parts",
    "load_audio_processor",
    "load_model",
    "load_processing",
    "load_video_processor",
]
