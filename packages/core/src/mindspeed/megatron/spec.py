"""Module specs that build megatron-core GPT layers from the kernel registry.

``get_gpt_layer_spec(kernels)`` returns a ``ModuleSpec`` like megatron's
``get_gpt_layer_local_spec`` (plain megatron ColumnParallel/RowParallel linears, so TP, SP,
PP, DDP and checkpoints behave exactly as upstream) with norms, core attention and the
SwiGLU activation replaced by :mod:`mindspeed.megatron.modules`, and MoE experts optionally as
one grouped matmul (:class:`~mindspeed.megatron.moe.RegistryGroupedMLP`). The kernels are a value,
``adapt(features=...)``'s ``report.kernels`` (or any op -> implementation mapping), passed in;
nothing is read from the adaptor's state. Rotary embeddings have no
spec seam in megatron-core; :func:`rotary_patch` routes them to the registry when the
``fused_rotary_pos_emb`` feature asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from mindspeed.features.context import KernelChoices
from mindspeed.megatron.coc import apply_coc
from mindspeed.megatron.modules import RegistryAttention, RegistryNorm, RegistrySwiGLU
from mindspeed.megatron.moe import RegistryGroupedMLP
from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.ops import resolve_kernel
from mindspeed.patching import UpstreamPatch

#: Registry ops the spec consumes, with their implementation chosen by ``impls``.
SPEC_OPS = ("rms_norm", "layer_norm", "attention", "swiglu")
#: The compute-communication overlap ops: chosen (the ``coc`` feature), they put
#: :mod:`mindspeed.megatron.coc`'s linears into the layer.
COC_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


class MindSpeedSpecProvider(LocalSpecProvider):
    """megatron's local backend with registry kernels for norms, attention and activation.

    Args:
        impls: the kernels: a :class:`~mindspeed.features.KernelChoices` (``report.kernels``
            of ``adapt()``), or op name -> implementation ("auto", "reference", or a backend)
            with "auto" for the ops it does not name.
    """

    def __init__(self, impls: Mapping[str, str] | None = None) -> None:
        self.kernels = KernelChoices.of(impls)
        self.impls = {op: self.kernels.kernel_for(op) for op in SPEC_OPS}

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> ModuleSpec:
        return ModuleSpec(module=RegistryNorm, params={"impl": self.impls["rms_norm" if rms_norm else "layer_norm"]})

    def core_attention(self, alibi: bool = False) -> ModuleSpec:
        """The registry attention; ``alibi``: with ALiBi's biases (this rank's heads' slopes)."""
        params: dict[str, Any] = {"impl": self.impls["attention"]}
        if alibi:
            params["alibi"] = True
        return ModuleSpec(module=RegistryAttention, params=params)

    def activation_func(self) -> ModuleSpec:
        return ModuleSpec(module=RegistrySwiGLU, params={"impl": self.impls["swiglu"]})

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool) -> tuple:
        """Grouped experts on the registry (``RegistryGroupedMLP``), else megatron's ``SequentialMLP``.

        No Transformer Engine or ``grouped_gemm`` package is needed for either; the legacy flag
        changes nothing here. The grouped module's kernel is this provider's ``grouped_matmul``.
        """
        if not moe_use_grouped_gemm:
            return super().grouped_mlp_modules(False, moe_use_legacy_grouped_gemm)
        return self.grouped_experts().module, MLPSubmodules(activation_func=self.activation_func())

    def grouped_experts(self) -> ModuleSpec:
        """The spec of grouped experts with this provider's ``grouped_matmul`` and ``swiglu`` kernels."""
        impl = self.kernels.kernel_for("grouped_matmul")
        return ModuleSpec(module=RegistryGroupedMLP, params={"impl": impl, "swiglu_impl": self.impls["swiglu"]})


def get_gpt_layer_spec(
    impls: Mapping[str, str] | None = None,
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = None,
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
    swiglu: bool = True,
    alibi: bool = False,
) -> ModuleSpec:
    """A GPT transformer-layer spec built from registry kernels.

    Args:
        impls: the kernels: ``adapt(features=...)``'s ``report.kernels`` (a
            :class:`~mindspeed.features.KernelChoices`: the features' choices, the reference
            for ops no feature chose), or op -> implementation for ``rms_norm``,
            ``layer_norm``, ``attention``, ``swiglu``, ``grouped_matmul`` with "auto" for the
            ops it does not name; ``None``: "auto" for every op.
        num_experts: MoE experts per layer (``None``: dense MLP).
        moe_grouped_gemm: ``True``: experts as one grouped matmul over the local experts
            (``RegistryGroupedMLP``, the ``grouped_matmul`` kernel of ``impls``);
            ``False``: megatron's ``SequentialMLP``; ``None`` (default): grouped when ``impls``
            chooses a ``grouped_matmul`` kernel (the ``moe_grouped_gemm`` feature), else sequential. The
            two have different parameter names (``experts.weight1``/``weight2`` against
            ``experts.local_experts.<i>.linear_fc*``); megatron's distributed checkpoints load
            into either.
        qk_layernorm: normalise queries and keys.
        normalization: "RMSNorm" or "LayerNorm".
        swiglu: route the gated activation to the registry (the TransformerConfig must then
            have ``gated_linear_unit=True``, ``activation_func=F.silu`` and
            ``use_te_activation_func=True``: the flag only tells megatron's MLP to call the
            spec's activation module, no Transformer Engine is involved).
        alibi: ALiBi biases in the core attention (build the ``GPTModel`` with
            ``position_embedding_type="none"``).
    """
    provider = MindSpeedSpecProvider(impls)
    # Always megatron's local spec with SequentialMLP: its GroupedMLP needs the grouped_gemm
    # package; grouped experts are swapped in below.
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization=normalization
    )
    norm = provider.layer_norm(rms_norm=normalization == "RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    attn = sub.self_attention.submodules
    attn.core_attention = provider.core_attention(alibi=alibi)
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = norm
    if swiglu:
        mlp_subs = sub.mlp.submodules
        # Dense: MLPSubmodules; MoE: MoESubmodules whose experts carry the MLP submodules.
        targets = [mlp_subs] if hasattr(mlp_subs, "activation_func") else []
        experts = getattr(mlp_subs, "experts", None)
        if experts is not None and getattr(experts, "submodules", None) is not None:
            targets.append(experts.submodules)
        shared = getattr(mlp_subs, "shared_experts", None)
        if shared is not None and getattr(shared, "submodules", None) is not None:
            targets.append(shared.submodules)
        for target in targets:
            target.activation_func = provider.activation_func()
    if any(op in provider.kernels for op in COC_OPS):
        apply_coc(spec, *(provider.kernels.kernel_for(op) for op in COC_OPS))
    if num_experts and ("grouped_matmul" in provider.kernels if moe_grouped_gemm is None else moe_grouped_gemm):
        sub.mlp.submodules.experts = provider.grouped_experts()
    return spec


def check_config_for_spec(config: Any, swiglu: bool = True) -> None:
    """Raise a ``ValueError`` naming the TransformerConfig field the registry spec needs."""
    if swiglu and not config.use_te_activation_func:
        raise ValueError(
            "the registry SwiGLU needs TransformerConfig(use_te_activation_func=True) so megatron's MLP "
            "calls the spec's activation module (no Transformer Engine is used), or get_gpt_layer_spec(swiglu=False)"
        )
    if config.attention_dropout:
        raise ValueError("set TransformerConfig(attention_dropout=0.0): the registry attention kernels have no dropout")


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos.to(dtype), sin.to(dtype)


def _rotary(original: Any, acc: Any, impl: str = "auto") -> Any:
    kernel = resolve_kernel("rotary_pos_emb", impl)
    # Every layer rotates its queries and keys with the same freqs tensor (built once per forward):
    # its cos/sin tables are computed once, not twice per layer.
    cached: list[Any] = [None, None]

    def tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # inside a compiled layer: computed in the graph (Inductor fuses it)
            return _cos_sin(freqs, mscale, dtype)
        key = (freqs._version, mscale, dtype, torch.is_grad_enabled())
        if cached[0] is not freqs or cached[1][0] != key:
            cached[0], cached[1] = freqs, (key, *_cos_sin(freqs, mscale, dtype))
        return cached[1][1], cached[1][2]

    def apply_rotary_pos_emb(
        t: torch.Tensor,
        freqs: torch.Tensor,
        config: Any,
        cu_seqlens: Any = None,
        mscale: float = 1.0,
        cp_group: Any = None,
    ) -> torch.Tensor:
        # The registry kernel covers the bshd layout, and packed (thd) sequences whose table has one
        # row per token without context parallelism (megatron's THD "exact mapping": the model
        # gathered it per token, as shared-prefix packing does; megatron splits the tokens per
        # segment, reads each offset from the device and applies the rows in order, i.e. the bshd
        # math on [T, 1, n, d]). MLA's permuted layout, other packed tables, CP and fused TE paths stay
        # with megatron's own implementation.
        exact = (
            cu_seqlens is not None
            and t.dim() == 3
            and freqs.dim() == 4
            and freqs.shape[0] == t.shape[0]
            and (cp_group is None or cp_group.size() == 1)
            and int(cu_seqlens[-1]) == t.shape[0]  # megatron's own test (it reads the lengths from the device too)
        )
        if (cu_seqlens is not None and not exact) or config.multi_latent_attention or config.apply_rope_fusion:
            return original(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        cos, sin = tables(freqs, mscale, t.dtype)
        if t.dim() == 3 and cos.dim() == 4:
            # A packed microbatch in a compiled layer (mindspeed.megatron.compiled_packing): [T, n, d]
            # with one table row per token (megatron's THD "exact mapping"), applied as [T, 1, n, d].
            return apply_rotary_pos_emb(t.unsqueeze(1), freqs, config, None, mscale, cp_group).squeeze(1)
        if t.dim() == 4 and cos.dim() == 4:
            # Computed on [b, n, s, d] views, so the result (handed back as megatron's [s, b, n, d])
            # lies in memory heads-major: the layout attention reads queries and keys in, without
            # a copy (the elementwise math does not care; SDPA on the [s, b, n, d] memory order
            # strides 16 KB between a head's rows: 3 ms more per layer of the small bench model).
            heads_major = kernel(
                t.permute(1, 2, 0, 3),
                cos.permute(1, 2, 0, 3),
                sin.permute(1, 2, 0, 3),
                interleaved=config.rotary_interleaved,
            )
            return heads_major.permute(2, 0, 1, 3)
        return kernel(t, cos, sin, interleaved=config.rotary_interleaved)

    return apply_rotary_pos_emb


def rotary_patch(impl: str = "auto") -> UpstreamPatch:
    """Route megatron's rotary embedding in attention to the registry kernel ``impl``."""
    return UpstreamPatch(
        name="rotary-pos-emb-kernel",
        target="megatron.core.transformer.attention.apply_rotary_pos_emb",
        make=lambda original, acc: _rotary(original, acc, impl),
        distribution="megatron-core",
        versions=MEGATRON_VERSIONS,
        reason="megatron-core has no spec seam for rotary embeddings; attention imports the function by name",
    )
