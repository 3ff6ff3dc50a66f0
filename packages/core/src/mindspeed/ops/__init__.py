"""The kernel registry and its ops.

Every op has a pure-PyTorch reference; backends add faster implementations where their
library and device are present. Pick one at build time::

    from mindspeed.ops import resolve_kernel
    rms_norm = resolve_kernel("rms_norm", impl="auto")   # logged once
    y = rms_norm(x, weight, eps=1e-6)

Importing this package registers the ops listed below into mindspeed's own registry; it
touches nothing outside it and imports no vendor library.
"""

# The manifest: ops first (each declares its reference), then the backends that add kernels.
# Registration happens here and nowhere else; a new op or backend module is added to this list.
from mindspeed.ops import (  # noqa: F401
    activations,
    adamw,
    attention,
    coc,
    ema_adamw,
    gated_delta_rule,
    grouped_matmul,
    matmul_add,
    moe_permute,
    norms,
    quant,
    ring_attention,
    rotary,
)
from mindspeed.ops.backends import bnb_quant, cuda_attention, cuda_fla, npu_attention, npu_basic, npu_coc, npu_moe  # noqa: F401
from mindspeed.ops.backends.compile import register_compiled_kernels
from mindspeed.ops.registry import (
    KERNELS,
    OPS,
    Case,
    KernelImpl,
    OpSpec,
    Tolerance,
    available_kernels,
    list_kernels,
    register_kernel,
    register_op,
    resolve_kernel,
)

register_compiled_kernels()

__all__ = [
    "KERNELS",
    "OPS",
    "Case",
    "KernelImpl",
    "OpSpec",
    "Tolerance",
    "available_kernels",
    "list_kernels",
    "register_kernel",
    "register_op",
    "resolve_kernel",
]
