"""Weight bridges between Hugging Face checkpoints and megatron-core GPT models.

Importing this package registers the families listed in :data:`FAMILY_MODULES` (the manifest:
adding a family is one module here plus a tiny config in :mod:`mindspeed_llm.testing.tiny_models`).
"""

from __future__ import annotations

import importlib

from mindspeed_llm.bridges.base import (
    BRIDGES,
    FAMILIES,
    Bridge,
    ConfigKey,
    bridge_for_architectures,
    bridge_for_family,
    register_bridge,
    supported_models,
)
from mindspeed_llm.bridges.engine import ConversionPlan, hf_to_megatron, megatron_to_hf, plan_conversion
from mindspeed_llm.bridges.layout import ParallelLayout, RankKey, merge_tensors, split_tensor
from mindspeed_llm.bridges.megatron_params import MegatronParam, Split, megatron_params
from mindspeed_llm.bridges.shape import ModelShape

#: The family modules; each registers its bridge when imported.
FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")

for _module in FAMILY_MODULES:
    importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "BRIDGES", "FAMILIES", "FAMILY_MODULES", "Bridge", "ConfigKey", "ConversionPlan", "MegatronParam", "ModelShape",
    "ParallelLayout", "RankKey", "Split", "bridge_for_architectures", "bridge_for_family", "hf_to_megatron",
    "megatron_params", "megatron_to_hf", "merge_tensors", "plan_conversion", "register_bridge", "split_tensor",
    "supported_models",
]
