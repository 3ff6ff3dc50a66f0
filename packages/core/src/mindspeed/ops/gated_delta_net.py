"""The token mixer of a Gated DeltaNet layer (Qwen3-Next's linear attention) as a function of its weights.

One definition serves megatron's layer (:class:`mindspeed.megatron.gated_delta_net.RegistryGatedDeltaNet`)
and the inference decoder, so both compute the same thing, with or without a carried state.
From the input projection (megatron's ``in_proj`` output, ``[q | k | v | z | b | a]`` of this
rank's heads) it runs:

- a causal depthwise convolution over ``[q | k | v]`` (width ``K``) and SiLU; the convolution
  reads the ``K - 1`` inputs before the first token from ``conv_state`` (zeros without one);
- L2-normalised queries and keys (FLA's eps), repeated per value head;
- the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and write strength ``beta = sigmoid(b)``
  (fp32), then the ``gated_delta_rule`` kernel from ``recurrent_state`` (zeros without one);
- the gated output norm: ``norm(o) * silu(z)`` per value head.

States: ``conv_state`` ``[batch, conv_channels, K - 1]``, ``recurrent_state`` ``[batch,
value_heads, key_dim, value_dim]`` (fp32); the new ones are returned for the next call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed.ops.gated_delta_rule import l2norm


@dataclass(frozen=True)
class DeltaNetHeads:
    """The heads one rank computes (all of them without tensor parallelism).

    Attributes:
        key_heads: query/key heads.
        value_heads: value heads (a multiple of ``key_heads``).
        key_dim: width of a query/key head.
        value_dim: width of a value head.
    """

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def sections(self) -> list[int]:
        """Widths of ``q, k, v, z, b, a`` in the input projection."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return [qk, qk, v, v, self.value_heads, self.value_heads]

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution (``q, k, v``)."""
        return sum(self.sections[:3])


def gated_delta_net_mix(
    projected: torch.Tensor,
    heads: DeltaNetHeads,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    out_norm: Callable[[torch.Tensor], torch.Tensor],
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    conv_state: torch.Tensor | None = None,
    recurrent_state: torch.Tensor | None = None,
    keep_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mixer's output before the output projection.

    Args:
        projected: ``[batch, seq, sum(heads.sections)]`` input projection.
        heads: this rank's head counts and widths.
        conv_weight: ``[conv_channels, 1, K]`` depthwise convolution weight (no bias).
        a_log, dt_bias: ``[value_heads]``.
        out_norm: the RMSNorm over a value head's width (its weight inside).
        kernel: a ``gated_delta_rule`` implementation (FLA's signature).
        conv_state: ``[batch, conv_channels, K - 1]`` inputs before the first token, or ``None``.
        recurrent_state: ``[batch, value_heads, key_dim, value_dim]`` state, or ``None``.
        keep_state: return the new states (else ``None`` for both).

    Returns:
        ``([batch, seq, value_heads * value_dim], conv_state, recurrent_state)``.
    """
    batch, seq, _ = projected.shape
    qkv, z, b, a = projected.split([heads.conv_channels, *heads.sections[3:]], dim=-1)
    width = conv_weight.shape[-1]
    x = qkv.transpose(1, 2)
    if conv_state is None:
        x = F.pad(x, (width - 1, 0))
    else:
        x = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    new_conv = x[..., x.shape[-1] - (width - 1) :] if keep_state else None
    qkv = F.silu(F.conv1d(x, conv_weight, groups=heads.conv_channels)).transpose(1, 2)
    q, k, v = qkv.split(heads.sections[:3], dim=-1)
    q = l2norm(q.reshape(batch, seq, heads.key_heads, heads.key_dim))
    k = l2norm(k.reshape(batch, seq, heads.key_heads, heads.key_dim))
    repeat = heads.value_heads // heads.key_heads
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    v = v.reshape(batch, seq, heads.value_heads, heads.value_dim)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    out, state = kernel(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g,
        b.sigmoid(),
        initial_state=recurrent_state,
        output_final_state=keep_state,
        use_qk_l2norm_in_kernel=False,
    )
    normed = out_norm(out.reshape(-1, heads.value_dim))
    gated = (normed * F.silu(z.reshape(-1, heads.value_dim).float())).to(out.dtype)
    return gated.reshape(batch, seq, -1), new_conv, state
