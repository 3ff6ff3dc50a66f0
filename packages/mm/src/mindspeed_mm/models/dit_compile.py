"""Regional compilation of a diffusers transformer (``train.compile``): ``torch.compile`` of its repeated blocks.

diffusers names the blocks a model repeats in ``ModelMixin._repeated_blocks`` (Wan:
``WanTransformerBlock``; FLUX: its double- and single-stream blocks), the seam its own
``compile_repeated_blocks`` uses. :func:`compile_blocks` compiles the ``forward`` of every such
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

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: ``train.compile`` values (``true`` is ``default``) and the ``torch.compile`` mode each runs (no CUDA graphs: the FSDP2 hooks
#: between blocks and the changing microbatches do not fit them).
MODES = {"default": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def compile_blocks(model: torch.nn.Module, mode: bool | str) -> list[str]:
    """Compile the ``forward`` of every repeated block of ``model`` (``mode``: a bool or a key of :data:`MODES`).

    Returns:
        the compiled blocks' names (empty for ``False``).

    Raises:
        ValueError: an unknown mode, or a model that names no repeated blocks.
    """
    if mode is False:
        return []
    mode = "default" if mode is True else mode
    if mode not in MODES:
        raise ValueError(f"train.compile={mode!r}: use true, false or {', '.join(MODES)}")
    classes = tuple(getattr(model, "_repeated_blocks", None) or ())
    blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ in classes]
    if not blocks:
        raise ValueError(
            f"train.compile={mode}: {type(model).__name__} names no repeated blocks (diffusers' _repeated_blocks) "
            "to compile; set train.compile=false"
        )
    for _, module in blocks:
        module.forward = torch.compile(module.forward, mode=MODES[mode], fullgraph=True, dynamic=False)
    logger.info("compile (%s): %d blocks of %s", mode, len(blocks), ", ".join(classes))
    return [name for name, _ in blocks]
