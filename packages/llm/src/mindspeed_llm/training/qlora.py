"""QLoRA: the frozen base weights of megatron linears stored in NF4, dequantised on the fly.

:func:`apply_qlora` is :func:`~mindspeed_llm.training.lora.apply_lora` followed by
:func:`quantize_base_weights`, which replaces the
``weight`` parameter of each adapted linear (and, with ``qlora_all_linears``, of the other
decoder linears) by NF4 buffers from the kernel registry's ``nf4_quantize``: packed 4-bit codes
plus double-quantised block maxima, about a quarter of the bf16 bytes. Each rank quantises its
own tensor-parallel piece, so the NF4 rounding depends on the layout (as with bitsandbytes
under any sharding).

The forward dequantises the weight to the input's dtype with the ``nf4_dequantize`` kernel
resolved once (reference on the CPU, bitsandbytes on CUDA where installed) and runs the same
``matmul`` + bias megatron's frozen-weight path runs, with megatron's own tensor-parallel
mappings around it: the output equals LoRA over the dequantised weight bit for bit. The
dequantised weight is not kept for the backward; it is dequantised again there.

The quantised weight has no state-dict entry (its buffers are not persistent): load the base
weights before ``apply_qlora``, and save / resume only the other parameters. Its buffers keep
their dtypes when the module is cast (``Float16Module`` calls ``.bfloat16()``), only device
moves apply to them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed.ops import resolve_kernel
from mindspeed_llm.training.lora import LORA_TARGETS, LoraLinear, LoraSettings, add_layer_mixin, apply_lora

logger = get_logger(__name__)

#: Buffers of a quantised weight (names on the module).
NF4_BUFFERS = ("nf4_codes", "nf4_absmax", "nf4_absmax_scale", "nf4_absmax_offset")


class _NF4Matmul(torch.autograd.Function):
    """``x @ W^T`` with ``W`` dequantised in the forward and again in the backward (not saved)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
        ctx.layer = layer
        return torch.matmul(x, layer.dequantized_weight(x.dtype).t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.matmul(ctx.layer.dequantized_weight(grad.dtype)), None


class NF4Linear:
    """Mixin that computes a megatron Column/RowParallelLinear from an NF4 weight.

    Non-expert layers only; ``gather_output`` and a ``weight`` argument are not supported.
    """

    layer_mixin_order = 1

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The full local weight in ``dtype`` (through the resolved ``nf4_dequantize`` kernel)."""
        return self.nf4_kernel(
            self.nf4_codes,
            self.nf4_absmax,
            self.nf4_shape,
            dtype,
            block_size=self.nf4_block_size,
            absmax_scale=self.nf4_absmax_scale,
            absmax_offset=self.nf4_absmax_offset,
            absmax_block_size=self.nf4_absmax_block_size,
        )

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, Any]:
        from megatron.core.tensor_parallel import mappings
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        if weight is not None or runtime_gather_output:
            raise ValueError("an NF4 linear computes from its own weight and does not gather its output")
        group = self.tp_group
        if isinstance(self, RowParallelLinear):
            x = input_ if self.input_is_parallel else mappings.scatter_to_tensor_model_parallel_region(input_, group)
            partial = _NF4Matmul.apply(x, self)
            output = (
                mappings.reduce_scatter_to_sequence_parallel_region(partial, group=group)
                if self.sequence_parallel
                else mappings.reduce_from_tensor_model_parallel_region(partial, group)
            )
            bias = self.bias
        else:
            # The input gradient is all-reduced (reduce-scattered under sequence parallelism) by
            # these mappings, as megatron's frozen-weight linear does it inside its backward.
            x = (
                mappings.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
                if self.sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region(input_, group)
            )
            output = _NF4Matmul.apply(x, self)
            bias = self.bias
        if self.skip_bias_add:
            return output, bias
        return (output + bias if bias is not None else output), None

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # Casting the module (Float16Module's .bfloat16()) must not round the fp32 scales of
        # the NF4 state; device moves still apply.
        saved = {name: getattr(self, name) for name in NF4_BUFFERS if getattr(self, name, None) is not None}
        result = super()._apply(fn, recurse)
        for name, original in saved.items():
            moved = getattr(self, name)
            if moved.dtype != original.dtype:
                self._buffers[name] = original.to(moved.device)
        return result


def quantize_linear(module: torch.nn.Module, settings: LoraSettings) -> int:
    """Replace ``module.weight`` by NF4 buffers; returns the bytes of its bf16 equivalent."""
    if getattr(module, "gather_output", False):
        raise ValueError("QLoRA does not quantise a linear that gathers its output")
    weight = module.weight.detach()
    quantize = resolve_kernel("nf4_quantize", "auto")
    state = quantize(weight, block_size=settings.qlora_block_size, double_quant=settings.qlora_double_quant)
    module.register_parameter("weight", None)
    for name, tensor in zip(NF4_BUFFERS, (state.codes, state.absmax, state.absmax_scale, state.absmax_offset)):
        module.register_buffer(name, tensor, persistent=False)
    module.nf4_shape, module.nf4_block_size, module.nf4_absmax_block_size = (
        state.shape,
        state.block_size,
        state.absmax_block_size,
    )
    module.nf4_kernel = resolve_kernel("nf4_dequantize", settings.qlora_impl)
    add_layer_mixin(module, NF4Linear)
    return weight.numel() * 2


def apply_qlora(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """QLoRA on one bare ``GPTModel`` chunk: LoRA on the target linears, then their frozen base in NF4.

    Args:
        model: a ``GPTModel`` (not wrapped by DDP) with its base weights loaded.
        settings: the LoRA settings (``qlora_all_linears`` quantises the other decoder linears too).

    Returns:
        The local names of the modules that got LoRA.
    """
    names = apply_lora(model, replace(settings, qlora=False))
    quantize_base_weights(model, settings)
    return names


def quantize_base_weights(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Quantise the frozen base weights of one chunk's adapted linears (all decoder linears of
    :data:`LORA_TARGETS` with ``settings.qlora_all_linears``); returns the quantised modules' names."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    names, bf16_bytes = [], 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or isinstance(module, NF4Linear):
            continue
        targeted = isinstance(module, LoraLinear)
        if targeted or (
            settings.qlora_all_linears and name.rsplit(".", 1)[-1] in LORA_TARGETS and not module.is_expert
        ):
            bf16_bytes += quantize_linear(module, settings)
            names.append(name)
    stored = quantized_bytes(model)
    logger.info(
        f"QLoRA: {len(names)} base weights in NF4, {stored / 2**20:.2f} MiB ({stored / max(bf16_bytes, 1):.3f} of bf16)"
    )
    return names


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of every NF4 buffer of one chunk (the frozen base of the quantised linears)."""
    total = 0
    for module in model.modules():
        if isinstance(module, NF4Linear):
            total += sum(
                b.numel() * b.element_size()
                for name, b in module.named_buffers(recurse=False)
                if name in NF4_BUFFERS and b is not None
            )
    return total
