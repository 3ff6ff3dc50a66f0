"""megatron-core modules made of registry kernels, plugged in through module specs.

Each module keeps megatron's constructor and forward signature, so a ``ModuleSpec`` can name
it in place of megatron's own; the kernel is resolved once at construction (``impl``:
"auto", "reference" or a backend name).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import nn

from mindspeed.ops import resolve_kernel


class RegistryNorm(nn.Module):
    """RMSNorm or LayerNorm (from ``config.normalization``) on the registry's kernel.

    Under sequence parallelism each rank normalises its own tokens; the weights are tagged
    ``sequence_parallel`` so megatron's ``finalize_model_grads`` all-reduces their gradients
    over the tensor-parallel group.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, impl: str = "auto", **_: Any) -> None:
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization {config.normalization!r} is not supported by RegistryNorm; "
                             "use RMSNorm or LayerNorm")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by RegistryNorm; set it to False")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
        self.kernel = resolve_kernel("rms_norm" if self.rms else "layer_norm", impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return self.kernel(x, self.weight, self.eps)
        return self.kernel(x, self.weight, self.bias, self.eps)


class RegistrySwiGLU(nn.Module):
    """The gated activation of megatron's MLP (``use_te_activation_func=True`` routes to it)."""

    def __init__(self, config: Any, impl: str = "auto", **_: Any) -> None:
        super().__init__()
        if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
            raise ValueError("RegistrySwiGLU needs gated_linear_unit=True and activation_func=F.silu")
        self.kernel = resolve_kernel("swiglu", impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)


class RegistryAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` on the registry's attention kernel.

    Takes megatron's ``[s, b, heads, dim]`` layout, supports causal and unmasked attention,
    GQA, ``config.window_size`` and ``config.softmax_scale``; packed sequences come with the
    context-parallel work.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        impl: str = "auto",
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout} is not supported by the registry attention kernels; "
                             "set attention_dropout=0.0 (usual for LLMs) or use megatron's DotProductAttention")
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism needs mindspeed's CP attention, not RegistryAttention")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        window = getattr(config, "window_size", None)
        self.window_size = tuple(window) if window is not None else (-1, -1)
        features = ("window",) if window is not None else ()
        self.kernel = resolve_kernel("attention", impl, features=features)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("packed sequences are not supported by RegistryAttention yet")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by RegistryAttention")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if not causal and mask_type != AttnMaskType.no_mask and attention_mask is not None:
            raise ValueError(f"attention mask type {mask_type} with an explicit mask is not supported; "
                             "use causal or no_mask")
        # [s, b, n, d] -> [b, s, n, d] for the kernel, and back to megatron's [s, b, n * d].
        out = self.kernel(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
            causal=causal, softmax_scale=self.softmax_scale, window_size=self.window_size,
        )
        sq, b = query.shape[0], query.shape[1]
        return out.transpose(0, 1).reshape(sq, b, -1)
