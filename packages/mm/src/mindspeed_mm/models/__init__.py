"""Vision-language model families, registered by their Hugging Face ``architectures`` name.

Importing this package registers the families listed below; each module declares one family
(:class:`~mindspeed_mm.models.family.VLMFamily`): how its parts are named, its FSDP2 plan, its
multimodal positions and its tiny test model.
"""

from mindspeed_mm.models import internvl, qwen2_5_vl, qwen3_vl  # noqa: F401  (register their architectures)
from mindspeed_mm.models.family import FAMILIES, VLMFamily, family_of
from mindspeed_mm.models.loading import freeze_parts, load_model, load_processing, load_video_processor

__all__ = [
    "FAMILIES",
    "VLMFamily",
    "family_of",
    "freeze_parts",
    "load_model",
    "load_processing",
    "load_video_processor",
]
