"""``gated_delta_rule`` on NVIDIA GPUs through flash-linear-attention (``fla.ops.gated_delta_rule``).

FLA's ``chunk_gated_delta_rule`` has the op's conventions (``[B, T, H, K]`` layout, log decay
``g``, ``scale`` default ``K ** -0.5``, the state ``[B, H, K, V]`` returned in fp32,
``use_qk_l2norm_in_kernel`` with eps 1e-6 inside the root) and its own Triton backward. Its
kernels are written for fp16/bf16 CUDA tensors: other inputs take the reference, logged once.
"""

from __future__ import annotations

import importlib.util

import torch

from mindspeed.log import get_logger, log_once
from mindspeed.ops.gated_delta_rule import check_gated_delta_rule_inputs, gated_delta_rule_reference
from mindspeed.ops.registry import register_kernel

logger = get_logger(__name__)


def _fla_usable() -> bool:
    if importlib.util.find_spec("fla") is None:
        return False
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401  (a broken install counts as absent)

    return True


@register_kernel("gated_delta_rule", "fla", devices=("cuda",), priority=20, available=_fla_usable)
def gated_delta_rule_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's chunked kernel; same arguments and results as the reference."""
    args = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        log_once(
            logger,
            f"gated_delta_rule[fla]: {q.dtype} on {q.device.type} is not supported by FLA's kernels "
            "(fp16/bf16 on CUDA); using the reference",
        )
        return gated_delta_rule_reference(q, k, v, g, beta, **args)
    check_gated_delta_rule_inputs(q, k, v, g, beta, initial_state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final_state = chunk_gated_delta_rule(q, k, v, g, beta, **args)
    return out, final_state
