"""The accelerator seam (npu, cuda, cpu).

The only package that names device families, collective libraries and vendor modules.
Ask it instead: ``get_accelerator().dist_backend``, ``.device()``, ``.ray_resource``, ...
"""

from mindspeed.device import cpu as _cpu  # noqa: F401  (registers the CPU)
from mindspeed.device import cuda as _cuda  # noqa: F401  (registers CUDA)
from mindspeed.device import npu as _npu  # noqa: F401  (registers the NPU; imports nothing vendor-side)
from mindspeed.device.accelerator import (
    ACCELERATOR_ENV,
    ACCELERATORS,
    Accelerator,
    available_accelerators,
    get_accelerator,
    register_accelerator,
    set_accelerator,
)
from mindspeed.device.determinism import deterministic_env, deterministic_mode
from mindspeed.device.host_memory import retain_freed_host_memory

__all__ = [
    "ACCELERATOR_ENV",
    "ACCELERATORS",
    "Accelerator",
    "available_accelerators",
    "deterministic_env",
    "deterministic_mode",
    "get_accelerator",
    "register_accelerator",
    "retain_freed_host_memory",
    "set_accelerator",
]
