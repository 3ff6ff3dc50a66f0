"""4-bit NormalFloat (NF4) weight quantisation: ``nf4_quantize`` and ``nf4_dequantize``.

The storage format is the one QLoRA introduced and bitsandbytes writes (``quantize_4bit`` with
``quant_type="nf4"``), so its kernels can read what the reference writes:

- the weight is flattened and cut into blocks of ``block_size`` values (64); every value is
  divided by its block's absolute maximum and replaced by the index of the nearest of the 16
  NF4 values (:data:`NF4_VALUES`, the table published with QLoRA);
- two 4-bit indices share one byte, the first element in the high nibble;
- with double quantisation the fp32 block maxima are centred on their mean (the offset) and
  quantised again to 8 bits, in blocks of ``absmax_block_size`` (256) maxima with one fp32
  scale each, against bitsandbytes' signed dynamic 8-bit map (:func:`dynamic_map_8bit`).

A weight of ``n`` values then takes ``n / 2 + n / 64 + 4 n / (64 * 256)`` bytes: 0.258 of its
bf16 size. A last block shorter than ``block_size`` (any ``numel``) is quantised on its own
values; an odd ``numel`` leaves the low nibble of the last byte at the code of 0.0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_op

#: The 16 NF4 values, ascending: quantiles of N(0, 1) scaled to [-1, 1] with an exact zero
#: (QLoRA, Dettmers et al. 2023, appendix E; the same constants as bitsandbytes).
NF4_VALUES: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
#: Index of 0.0 in :data:`NF4_VALUES`: the code of padding.
NF4_ZERO_CODE = 7
#: Block sizes bitsandbytes' kernels accept (the reference takes the same, so any state it
#: writes can be dequantised by every backend).
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
ABSMAX_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
#: Values (de)quantised per step (a multiple of every block size).
CHUNK = 1 << 16


class NF4Weight(NamedTuple):
    """A quantised weight: what :func:`nf4_quantize_reference` returns.

    Attributes:
        codes: uint8 ``[ceil(numel / 2)]``, two NF4 indices per byte (first in the high nibble).
        absmax: per-block maxima: uint8 ``[num_blocks]`` codes of the dynamic 8-bit map with
            double quantisation, else float32 ``[num_blocks]``.
        absmax_scale: float32 ``[ceil(num_blocks / absmax_block_size)]`` (double quantisation).
        absmax_offset: float32 scalar added back to the dequantised maxima (double quantisation).
        shape: the original weight's shape.
        block_size: values per NF4 block.
        absmax_block_size: maxima per 8-bit block.
    """

    codes: torch.Tensor
    absmax: torch.Tensor
    absmax_scale: torch.Tensor | None
    absmax_offset: torch.Tensor | None
    shape: tuple[int, ...]
    block_size: int
    absmax_block_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of the state."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The state's tensors (``None`` fields left out)."""
        return [t for t in (self.codes, self.absmax, self.absmax_scale, self.absmax_offset) if t is not None]

    def dequantize_kwargs(self) -> dict:
        """Keyword arguments of ``nf4_dequantize`` besides ``codes``, ``absmax``, ``shape``, ``dtype``."""
        return {
            "block_size": self.block_size,
            "absmax_scale": self.absmax_scale,
            "absmax_offset": self.absmax_offset,
            "absmax_block_size": self.absmax_block_size,
        }


@functools.cache
def _nf4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


@functools.cache
def _nf4_pairs(device: torch.device) -> torch.Tensor:
    # Byte b -> (NF4[b >> 4], NF4[b & 15]): one lookup decodes both values of a byte.
    table = _nf4_table(device)
    return torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1)


@functools.cache
def _dynamic_map(device: torch.device) -> torch.Tensor:
    # Signed, 7 exponent bits: for each decade 10^-6 .. 10^0 the midpoints of 2^i equal steps of
    # [0.1, 1], both signs, then 0 and 1 (bitsandbytes' create_dynamic_map, computed in fp32 so
    # the values are the same to the bit).
    values: list[float] = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (i - 6)
        values += (scale * means).tolist() + (-scale * means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32, device=device)


def dynamic_map_8bit(device: torch.device | str = "cpu") -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (256 ascending float32 values in [-1, 1])."""
    return _dynamic_map(torch.device(device))


def _check_block_size(name: str, value: int, allowed: Sequence[int]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value} is not supported; use one of {', '.join(map(str, allowed))}")


def _blockwise_codes(flat: torch.Tensor, block_size: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-value indices of ``flat / blockmax`` in the sorted ``table``, and the block maxima.

    Works through :data:`CHUNK` values at a time, so the fp32 temporaries of a large weight
    stay bounded.
    """
    midpoints = (table[:-1] + table[1:]) / 2
    codes, maxima = [], []
    step = max(CHUNK - CHUNK % block_size, block_size)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step].float()
        numel = part.numel()
        blocks = -(-numel // block_size)
        if numel % block_size:
            part = torch.nn.functional.pad(part, (0, blocks * block_size - numel))
        part = part.view(blocks, block_size)
        absmax = part.abs().amax(dim=1)
        # A block of zeros keeps absmax 0 (it dequantises to zeros); the clamp only avoids 0/0.
        scaled = (part * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp_(-1.0, 1.0)
        codes.append(torch.bucketize(scaled.view(-1)[:numel], midpoints, out_int32=True).to(torch.uint8))
        maxima.append(absmax)
    return torch.cat(codes), torch.cat(maxima)


def nf4_quantize_reference(
    weight: torch.Tensor, block_size: int = 64, double_quant: bool = True, absmax_block_size: int = 256
) -> NF4Weight:
    """Quantise ``weight`` to NF4 (blockwise absmax scaling), optionally double-quantising the maxima.

    Args:
        weight: a floating tensor of any shape and at least one element.
        block_size: values per block (a power of two, 32 to 4096).
        double_quant: quantise the fp32 block maxima to 8 bits (QLoRA's double quantisation).
        absmax_block_size: maxima per 8-bit block (a power of two, 64 to 4096).

    Returns:
        The :class:`NF4Weight` state, on ``weight``'s device.

    Raises:
        ValueError: an empty or non-floating weight, or an unsupported block size.
    """
    if not weight.is_floating_point() or weight.numel() == 0:
        raise ValueError(f"nf4_quantize needs a non-empty floating tensor, got {weight.dtype}{list(weight.shape)}")
    _check_block_size("block_size", block_size, BLOCK_SIZES)
    _check_block_size("absmax_block_size", absmax_block_size, ABSMAX_BLOCK_SIZES)
    flat = weight.detach().reshape(-1)
    codes, absmax = _blockwise_codes(flat, block_size, _nf4_table(flat.device))
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), NF4_ZERO_CODE)])
    packed = (codes[0::2] << 4) | codes[1::2]
    scale = offset = None
    if double_quant:
        offset = absmax.mean()
        absmax, scale = _blockwise_codes(absmax - offset, absmax_block_size, _dynamic_map(flat.device))
    return NF4Weight(packed, absmax, scale, offset, tuple(weight.shape), block_size, absmax_block_size)


def _scale_blocks(values: torch.Tensor, scales: torch.Tensor, block_size: int, inplace: bool = False) -> torch.Tensor:
    numel = values.numel()
    blocks = scales.numel()
    if numel == blocks * block_size:
        blocked = values.view(blocks, block_size)
        return (blocked.mul_(scales.unsqueeze(1)) if inplace else blocked * scales.unsqueeze(1)).view(-1)
    padded = torch.nn.functional.pad(values, (0, blocks * block_size - numel)).view(blocks, block_size)
    return (padded * scales.unsqueeze(1)).reshape(-1)[:numel]


def dequantize_absmax(
    absmax: torch.Tensor,
    absmax_scale: torch.Tensor | None,
    absmax_offset: torch.Tensor | None,
    absmax_block_size: int = 256,
) -> torch.Tensor:
    """The float32 block maxima of an NF4 state (undoing double quantisation when ``absmax`` is uint8)."""
    if absmax.dtype != torch.uint8:
        return absmax.float()
    if absmax_scale is None or absmax_offset is None:
        raise ValueError("double-quantised absmax (uint8) needs absmax_scale and absmax_offset")
    values = _dynamic_map(absmax.device)[absmax.long()]
    return _scale_blocks(values, absmax_scale.float(), absmax_block_size) + absmax_offset.float()


def nf4_dequantize_reference(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
    absmax_scale: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
    absmax_block_size: int = 256,
) -> torch.Tensor:
    """The weight an NF4 state stands for, ``NF4_VALUES[code] * blockmax``, in ``dtype``.

    Computed in float32 and cast once (as bitsandbytes' kernels do).

    Args:
        codes: packed uint8 codes (:attr:`NF4Weight.codes`).
        absmax: the block maxima, uint8 (double-quantised) or float32.
        shape: the weight's shape.
        dtype: output dtype.
        block_size: values per block.
        absmax_scale: the 8-bit blocks' scales (double quantisation).
        absmax_offset: the maxima's offset (double quantisation).
        absmax_block_size: maxima per 8-bit block.

    Raises:
        ValueError: codes or maxima that do not fit ``shape``.
    """
    numel = math.prod(shape)
    blocks = -(-numel // block_size)
    if codes.dtype != torch.uint8 or codes.numel() != (numel + 1) // 2 or absmax.numel() != blocks:
        raise ValueError(
            f"an NF4 state of shape {tuple(shape)} and block size {block_size} needs "
            f"{(numel + 1) // 2} uint8 codes and {blocks} maxima, got {codes.dtype}{list(codes.shape)} "
            f"and {absmax.numel()}"
        )
    maxima = dequantize_absmax(absmax, absmax_scale, absmax_offset, absmax_block_size)
    pairs = _nf4_pairs(codes.device)
    flat = codes.reshape(-1)
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    # Chunks of whole blocks bound the fp32 temporaries (a forward dequantises every weight).
    step = max(CHUNK - CHUNK % block_size, block_size)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        values = torch.nn.functional.embedding(flat[start // 2 : (stop + 1) // 2].int(), pairs).view(-1)[: stop - start]
        first = start // block_size
        out[start:stop] = _scale_blocks(
            values, maxima[first : first + -(-(stop - start) // block_size)], block_size, inplace=True
        )
    return out.view(tuple(shape))


# -- registry ---------------------------------------------------------------------------------


def _weights(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weights = {
        "2d 64x128": torch.randn(64, 128, generator=gen),
        "odd numel 7x37": torch.randn(7, 37, generator=gen),
        "1d 1000, outliers": torch.randn(1000, generator=gen) * torch.linspace(0.01, 20.0, 1000),
        "zero block": torch.cat([torch.zeros(64), torch.randn(192, generator=gen)]),
    }
    return {name: w.to(device, dtype) for name, w in weights.items()}


def _quantize_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = [Case(name, (w,), grad=False) for name, w in _weights(device, dtype).items()]
    return cases + [
        Case("single quant, block 128", (cases[0].args[0],), {"block_size": 128, "double_quant": False}, grad=False)
    ]


def _dequantize_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = []
    for name, weight in _weights(device, torch.float32).items():
        for double in (True, False):
            q = nf4_quantize_reference(weight, double_quant=double)
            kwargs = {"dtype": dtype, **q.dequantize_kwargs()}
            cases.append(
                Case(f"{name}{'' if double else ', single quant'}", (q.codes, q.absmax, q.shape), kwargs, grad=False)
            )
    return cases


def _bench_weight(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(4096, 4096, device=device, dtype=dtype)


def _dequantize_bench(dtype: torch.dtype, device: torch.device) -> Case:
    q = nf4_quantize_reference(_bench_weight(torch.float32, device))
    return Case("4096x4096", (q.codes, q.absmax, q.shape), {"dtype": dtype, **q.dequantize_kwargs()}, grad=False)


_EXACT = {torch.float32: Tolerance(atol=0.0, rtol=0.0)}

register_op(
    OpSpec(
        name="nf4_quantize",
        reference=nf4_quantize_reference,
        doc="NF4 blockwise quantisation (QLoRA / bitsandbytes format), optional double-quantised absmax",
        cases=_quantize_cases,
        bench_case=lambda dtype, device: Case("4096x4096", (_bench_weight(dtype, device),), grad=False),
        tolerances=_EXACT,
    )
)
register_op(
    OpSpec(
        name="nf4_dequantize",
        reference=nf4_dequantize_reference,
        doc="NF4 dequantisation to a compute dtype (fp32 math, one cast)",
        cases=_dequantize_cases,
        bench_case=_dequantize_bench,
        tolerances=_EXACT,
    )
)
