"""Ascend NPUs through torch_npu, collectives over HCCL.

torch_npu is imported lazily and only when installed: its absence is the normal case. It is
never imported at module import time, because importing it without the CANN toolkit fails.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from mindspeed.device.accelerator import Accelerator, register_accelerator
from mindspeed.log import get_logger

logger = get_logger(__name__)

_probe: bool | None = None


def import_torch_npu() -> Any | None:
    """Import torch_npu if it is installed and loads; ``None`` otherwise (logged once)."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as err:  # installed without CANN, say
        logger.warning("torch_npu is installed but does not load (%s); NPUs are not used", err)
        return None


@register_accelerator
class NpuAccelerator(Accelerator):
    """A Huawei Ascend NPU."""

    name = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"
    priority = 20

    @classmethod
    def is_available(cls) -> bool:
        global _probe
        if _probe is None:
            _probe = import_torch_npu() is not None and hasattr(torch, "npu") and torch.npu.is_available()
        return _probe

    @property
    def torch_module(self) -> Any:
        return torch.npu

    def deterministic_env(self) -> dict[str, str]:
        # MindSpeed's --npu-deterministic: HCCL reduces in a fixed order, and matmuls keep
        # their K-axis accumulation order; torch_npu's kernels follow
        # torch.use_deterministic_algorithms.
        return {"HCCL_DETERMINISTIC": "true", "CLOSE_MATMUL_K_SHIFT": "1"}

    def capabilities(self) -> frozenset[str]:
        return frozenset({"bf16", "streams", "pinned_memory"})
