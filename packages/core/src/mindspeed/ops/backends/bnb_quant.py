"""``nf4_dequantize`` on NVIDIA GPUs through bitsandbytes (``bitsandbytes.functional.dequantize_4bit``).

The reference writes bitsandbytes' own NF4 layout (high nibble first, fp32 or double-quantised
uint8 maxima against the dynamic 8-bit map, an offset), so a state is handed over as a
``QuantState`` without conversion; the nested state carries our dynamic map as its ``code``,
which makes the result equal the reference's bit for bit (both compute in fp32 and cast once).
bitsandbytes is imported on the first call, never at registration; its presence is probed with
``importlib.util.find_spec``.

No Ascend kernel is registered: torch_npu has no NF4 (lookup-table) dequantisation, only
``npu_weight_quant_batchmatmul`` for linear int8/int4 weights with a scale and offset, and the
Ascend port of bitsandbytes packs nibbles in the other order with shifted code indices.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from mindspeed.ops.quant import dynamic_map_8bit, nf4_dequantize_reference
from mindspeed.ops.registry import register_kernel

_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _bitsandbytes_present() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


@register_kernel("nf4_dequantize", "bitsandbytes", devices=("cuda",), priority=20, available=_bitsandbytes_present)
def nf4_dequantize_bnb(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
    absmax_scale: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
    absmax_block_size: int = 256,
) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit`` with ``quant_type="nf4"``; same arguments as the reference."""
    if codes.device.type != "cuda" or dtype not in _OUTPUT_DTYPES or codes.numel() < 2:
        # bitsandbytes returns a one-row packed tensor transposed; tiny states are not worth a kernel.
        return nf4_dequantize_reference(
            codes, absmax, shape, dtype, block_size, absmax_scale, absmax_offset, absmax_block_size
        )
    from bitsandbytes.functional import QuantState, dequantize_4bit

    shape = torch.Size(shape)
    if absmax.dtype == torch.uint8:
        nested = QuantState(
            absmax=absmax_scale.float(),
            code=dynamic_map_8bit(codes.device),
            blocksize=absmax_block_size,
            dtype=torch.float32,
        )
        state = QuantState(
            absmax=absmax,
            shape=shape,
            blocksize=block_size,
            quant_type="nf4",
            dtype=dtype,
            offset=absmax_offset.float(),
            state2=nested,
        )
    else:
        state = QuantState(absmax=absmax.float(), shape=shape, blocksize=block_size, quant_type="nf4", dtype=dtype)
    # bitsandbytes keeps packed weights as a column [(n + 1) // 2, 1].
    return dequantize_4bit(codes.reshape(-1, 1), quant_state=state)
