"""Regional compilation of a diffusers transformer (``train.compile``): ``torch.compile`` of its repeated blocks.

diffusers names the blocks a model repeats in ``ModelMixin._repeated_blocks`` (Wan:
``WanTransformerBlock``; FLUX: its double- and single-stream blocks), the seam its own
``compile_repeated_blocks`` uses. :func:`compile_blocks` compiles (with the core's
:func:`mindspeed.compile.compile_forwards`, shared with the LLM trainer's compiled layers) the ``forward`` of every such
block in place, as recompute wraps it (``mindspeed_mm.trainer.fsdp``): the module hooks that FSDP2,
recompute and the task add stay outside the compiled region, the parameter names (checkpoints,
exports) do not change, and the blocks of one class share one graph (same code, same shapes),
so a 40-block model compiles once per class and latent shape.

Inductor fuses the elementwise work around the matrix products and the attention (AdaLN
modulation, gated residuals, QK RMSNorm, rotary, GELU, and their backward), which eager runs op
by op; ``max-autotune`` also times its own GEMM kernels (epilogues fused) against ATen's and keeps
the faster. The math is the model's: losses equal the uncompiled run within fp32 rounding.
"""

from __future__ import annotations

import torch

from mindspeed.compile import MODES, compile_forwards, compile_mode
from mindspeed.log import get_logger

logger = get_logger(__name__)

__all__ = ["MODES", "compile_blocks"]


def compile_blocks(model: torch.nn.Module, mode: bool | str) -> list[str]:
    """Compile the ``forward`` of every repeated block of ``model`` (``mode``: a bool or a key of :data:`MODES`).

    Returns:
        the compiled blocks' names (empty for ``False``).

    Raises:
        ValueError: an unknown mode, or a model that names no repeated blocks.
    """
    key = compile_mode(mode)
    if key is None:
        return []
    classes = tuple(getattr(model, "_repeated_blocks", None) or ())
    blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ in classes]
    if not blocks:
        raise ValueError(
            f"train.compile={key}: {type(model).__name__} names no repeated blocks (diffusers' _repeated_blocks) "
            "to compile; set train.compile=false"
        )
    names = compile_forwards(blocks, key)
    logger.info("compile (%s): %d blocks of %s", key, len(blocks), ", ".join(classes))
    return names
