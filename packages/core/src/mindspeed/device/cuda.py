"""NVIDIA GPUs through torch.cuda, collectives over NCCL."""

from __future__ import annotations

from typing import Any

import torch

from mindspeed.device.accelerator import Accelerator, register_accelerator


@register_accelerator
class CudaAccelerator(Accelerator):
    """An NVIDIA (or ROCm, which torch also exposes as ``cuda``) GPU."""

    name = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    priority = 10

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @property
    def torch_module(self) -> Any:
        return torch.cuda

    def deterministic_env(self) -> dict[str, str]:
        # cuBLAS reduces in a fixed order only with a fixed workspace; NCCL picks its all-reduce
        # algorithm per message size unless told (megatron's deterministic mode asks for one).
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}

    def set_deterministic(self, enabled: bool) -> dict[str, Any]:
        cudnn = torch.backends.cudnn
        previous = {"deterministic": cudnn.deterministic, "benchmark": cudnn.benchmark}
        cudnn.deterministic, cudnn.benchmark = enabled, (not enabled) and cudnn.benchmark
        return previous

    def restore_deterministic(self, previous: dict[str, Any]) -> None:
        for key, value in previous.items():
            setattr(torch.backends.cudnn, key, value)

    def capabilities(self) -> frozenset[str]:
        caps = {"streams", "pinned_memory"}
        if torch.cuda.is_bf16_supported():
            caps.add("bf16")
        if torch.cuda.get_device_capability() >= (8, 9):
            caps.add("fp8")
        return frozenset(caps)
