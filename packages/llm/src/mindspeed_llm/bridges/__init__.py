"""Weight bridges between Hugging Face checkpoints and megatron-core GPT models.

Importing this package registers every family module in :mod:`mindspeed_llm.bridges.families`
(:data:`FAMILY_MODULES`, found on disk): adding a family is one module there plus a tiny config in
:mod:`mindspeed_llm.testing.tiny_models` (docs/llm/adding-a-model.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from mindspeed_llm.bridges import families
from mindspeed_llm.bridges.base import (
    BRIDGES,
    FAMILIES,
    Bridge,
    Capabilities,
    ConfigKey,
    bridge_for_architectures,
    bridge_for_family,
    bridge_for_shape,
    families_with,
    register_bridge,
    require_capability,
    supported_models,
)
from mindspeed_llm.bridges.engine import ConversionPlan, hf_to_megatron, megatron_to_hf, plan_conversion
from mindspeed_llm.bridges.layout import ParallelLayout, RankKey, merge_tensors, split_tensor
from mindspeed_llm.bridges.megatron_params import MegatronParam, Split, megatron_params
from mindspeed_llm.bridges.shape import ModelShape

#: The family modules (in name order; the order of the family registry: on equal shapes the
#: first family wins); each registers its bridge when imported.
FAMILY_MODULES = tuple(sorted(info.name for info in pkgutil.iter_modules(families.__path__)))

for _module in FAMILY_MODULES:
    importlib.import_module(f"{families.__name__}.{_module}")

__all__ = [
    "BRIDGES",
    "FAMILIES",
    "FAMILY_MODULES",
    "Bridge",
    "Capabilities",
    "ConfigKey",
    "ConversionPlan",
    "MegatronParam",
    "ModelShape",
    "ParallelLayout",
    "RankKey",
    "Split",
    "bridge_for_architectures",
    "bridge_for_family",
    "bridge_for_shape",
    "families_with",
    "hf_to_megatron",
    "megatron_params",
    "megatron_to_hf",
    "merge_tensors",
    "plan_conversion",
    "register_bridge",
    "require_capability",
    "split_tensor",
    "supported_models",
]
