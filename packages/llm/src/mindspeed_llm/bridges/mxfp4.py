"""MXFP4 expert weights as GPT-OSS releases them (``*_blocks`` + ``*_scales``), dequantised.

OCP microscaling FP4: every group of 32 weights along a row shares one power-of-two scale
(``scales``: uint8 biased exponent, ``2 ** (scale - 127)``), and every weight is a 4-bit E2M1
code, two per byte in ``blocks`` (low nibble first). GPT-OSS stores a projection ``[experts,
out, in]`` as ``blocks [experts, out, in / 32, 16]`` and ``scales [experts, out, in / 32]``;
transformers' checkpoints hold the dequantised weight transposed, ``[experts, in, out]``, which
is what :func:`dequantize_mxfp4` returns (in bfloat16, as transformers' integration does: every
E2M1 value times a power of two is exact there).
"""

from __future__ import annotations

import torch

#: The 16 E2M1 values by 4-bit code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: The suffixes of a quantised tensor's two parts in the checkpoint.
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``[experts, in, out]`` of MXFP4 ``blocks [experts, out, groups, 16]`` and ``scales [experts, out, groups]``.

    Raises:
        ValueError: the parts' dtypes or shapes do not fit together.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks [experts, out, groups, bytes] {list(blocks.shape)} do not fit scales {list(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes]  # [experts, out, groups, 32]
    exponent = scales.to(torch.int32) - 127
    weight = torch.ldexp(values, exponent.unsqueeze(-1)).to(dtype)
    return weight.flatten(-2).transpose(1, 2).contiguous()


def quantized_name(name: str) -> tuple[str, str]:
    """The two checkpoint names (blocks, scales) a quantised tensor ``name`` is stored under."""
    return name + BLOCKS, name + SCALES


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``(blocks, scales)`` of a weight ``[experts, in, out]`` (``in`` a multiple of 32), the
    inverse layout of :func:`dequantize_mxfp4`: per group of 32 the scale ``2 ** ceil(log2(amax / 6))``,
    every value rounded to the nearest E2M1 code (for writing MXFP4 checkpoints in tests).

    Raises:
        ValueError: ``weight`` is not 3-D or ``in`` is not a multiple of 32.
    """
    if weight.dim() != 3 or weight.shape[1] % 32:
        raise ValueError(f"MXFP4 needs a weight [experts, in, out] with in a multiple of 32; got {list(weight.shape)}")
    rows = weight.float().transpose(1, 2)  # [experts, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    table = torch.tensor(E2M1_VALUES)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)  # [..., 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)
