"""megatron-core's Gated DeltaNet layer (``megatron.core.ssm.gated_delta_net``) on the kernel registry.

megatron-core 0.16's ``GatedDeltaNet`` (Qwen3-Next's linear-attention layer) calls
flash-linear-attention by module-level names: ``chunk_gated_delta_rule`` for the recurrence and
``l2norm`` for queries and keys, and its constructor refuses to build when FLA is missing
(``HAVE_FLA``). The kernel has no spec seam, so :func:`gated_delta_net_patches` binds those
names to the registry's ``gated_delta_rule`` (``impl``: ``"auto"`` is FLA itself on CUDA where it
is installed, the chunked reference elsewhere) and to FLA's l2norm definition. The layer's
linear layers and output norm do have a seam: :func:`get_gated_delta_net_spec` builds them
from megatron's local linears and the registry norm.

What the models build (the Qwen3-Next bridge, the trainer) is :class:`RegistryGatedDeltaNet`: the
same class with a forward on the registry kernel (:func:`get_registry_gated_delta_net_spec`), so
nothing of megatron's module is rebound while a model runs; the patches stay for running
megatron's own class unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mindspeed.device import get_accelerator
from mindspeed.device.cuda_shim import SHIMMED_ACCELERATORS
from mindspeed.megatron.modules import RegistryNorm
from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.megatron.shared_prefix import SharedPrefixParams
from mindspeed.megatron.spec import MindSpeedSpecProvider
from mindspeed.ops import resolve_kernel
from mindspeed.ops.gated_delta_net import DeltaNetHeads, gated_delta_net_mix
from mindspeed.ops.gated_delta_rule import l2norm
from mindspeed.patching import PatchSet, UpstreamPatch

_GDN = "megatron.core.ssm.gated_delta_net"


def _kernel(impl: str) -> Any:
    kernel = resolve_kernel("gated_delta_rule", impl)

    def chunk_gated_delta_rule(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # FLA's call signature (megatron passes q, k, v by position, the rest by keyword).
        return kernel(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )

    chunk_gated_delta_rule.kernel = kernel
    return chunk_gated_delta_rule


def _eager(original: Any, acc: Any) -> Any:
    # jit_fuser wraps the method with torch.compile; the wrapper keeps the plain function.
    return getattr(original, "_torchdynamo_orig_callable", original)


def _have_fla_patch() -> UpstreamPatch:
    return UpstreamPatch(
        name="gdn-have-fla",
        target=f"{_GDN}.HAVE_FLA",
        make=lambda original, acc: True,
        reason="GatedDeltaNet's constructor refuses to build without FLA; its kernel is bound above",
        distribution="megatron-core",
        versions=MEGATRON_VERSIONS,
    )


def gated_delta_net_patches(impl: str = "auto") -> list[UpstreamPatch]:
    """Patches that let megatron's ``GatedDeltaNet`` build and run on the registry kernel ``impl``.

    All are reverted by ``unadapt()`` (or ``PatchSet.revert``); where FLA is installed its
    names are put back.
    """
    common = dict(distribution="megatron-core", versions=MEGATRON_VERSIONS)
    return [
        UpstreamPatch(
            name="gdn-kernel",
            target=f"{_GDN}.chunk_gated_delta_rule",
            make=lambda original, acc: _kernel(impl),
            reason="GatedDeltaNet calls FLA's chunk_gated_delta_rule by module name (None without FLA): "
            "the registry's gated_delta_rule goes there",
            **common,
        ),
        UpstreamPatch(
            name="gdn-l2norm",
            target=f"{_GDN}.l2norm",
            make=lambda original, acc: l2norm,
            reason="GatedDeltaNet normalises queries and keys with FLA's l2norm (unbound without FLA)",
            allow_missing=True,
            **common,
        ),
        _have_fla_patch(),
        UpstreamPatch(
            name="gdn-gated-norm-eager",
            target=f"{_GDN}.GatedDeltaNet._apply_gated_norm",
            make=_eager,
            reason="the output norm-and-gate is wrapped in torch.compile (jit_fuser): off CUDA inductor "
            "compiles it at the first call and for every new shape; eager computes the same",
            accelerators=SHIMMED_ACCELERATORS,
            **common,
        ),
    ]


def get_gated_delta_net_spec(impls: Mapping[str, str] | None = None) -> ModuleSpec:
    """The spec of megatron's ``GatedDeltaNet`` with local linears and the registry RMSNorm.

    The input projection is a plain ``ColumnParallelLinear`` (the transformer layer's
    ``input_layernorm`` normalises before it, ``metainfo["fuse_input_layernorm"] = False``) and
    the output norm a :class:`~mindspeed.megatron.modules.RegistryNorm` on ``impls``'
    ``rms_norm`` kernel. The recurrence itself is bound by :func:`gated_delta_net_patches`.
    """
    provider = MindSpeedSpecProvider(impls)
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=provider.layer_norm(rms_norm=True), out_proj=RowParallelLinear
        ),
        metainfo={"fuse_input_layernorm": False},
    )


class RegistryGatedDeltaNet(GatedDeltaNet):
    """megatron's ``GatedDeltaNet`` (same parameters, sharding and checkpoints) whose forward runs
    :func:`mindspeed.ops.gated_delta_net.gated_delta_net_mix` on the registry's ``gated_delta_rule``.

    No module-level name of megatron is rebound while it runs: only its constructor's FLA check is
    lifted, for the duration of the constructor (a reverted patch). Sequence parallelism works as
    upstream (the input projection gathers the sequence, the output projection scatters it back).

    Args:
        impl: the ``gated_delta_rule`` implementation ("auto", "reference", "recurrent", ...).
        *args, **kwargs: megatron's ``GatedDeltaNet`` arguments.
    """

    def __init__(self, *args: Any, impl: str = "auto", **kwargs: Any) -> None:
        patches = PatchSet([_have_fla_patch()])
        patches.apply(get_accelerator())
        try:
            super().__init__(*args, **kwargs)
        finally:
            patches.revert()
        self.kernel = resolve_kernel("gated_delta_rule", impl)
        self.heads = DeltaNetHeads(
            self.num_key_heads // self.tp_size, self.num_v_heads_local_tp, self.key_head_dim, self.value_head_dim
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        key_value_states: Any = None,
        inference_context: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Any = None,
        *,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> (output ``[s, b, h]``, bias): causal over each row (no padding mask), or
        over each packed sequence of ``packed_seq_params`` (THD, ``[t, 1, h]``)."""
        if inference_context is not None or inference_params is not None:
            raise ValueError(
                "RegistryGatedDeltaNet has no megatron inference context; generate with the inference engine"
            )
        projected, _ = self.in_proj(hidden_states)
        projected = projected.transpose(0, 1)
        bounds = [0, projected.shape[1]]
        if packed_seq_params is not None:
            bounds = _segments(packed_seq_params, projected.shape[1])
        mixed = torch.cat(
            [
                gated_delta_net_mix(
                    projected[:, start:end],
                    self.heads,
                    self.conv1d.weight,
                    self.A_log,
                    self.dt_bias,
                    self.out_norm,
                    self.kernel,
                )[0]
                for start, end in zip(bounds[:-1], bounds[1:])
            ],
            dim=1,
        )
        return self.out_proj(mixed.transpose(0, 1).contiguous())


def _segments(params: Any, tokens: int) -> list[int]:
    """Segment boundaries of packed (THD) sequences: each runs its own recurrence from zero state;
    tokens after the last sequence (padding) form one more segment."""
    if isinstance(params, SharedPrefixParams):
        raise ValueError(
            "shared-prefix packing is not supported by Gated DeltaNet layers; pack each sequence on its own"
        )
    if getattr(params, "qkv_format", "thd") != "thd" or getattr(params, "cu_seqlens_q", None) is None:
        raise ValueError("Gated DeltaNet layers take packed sequences only as qkv_format='thd' with cu_seqlens_q")
    bounds = [int(x) for x in params.cu_seqlens_q.tolist()]
    if bounds[-1] < tokens:
        bounds.append(tokens)
    return sorted(set(bounds))


def get_registry_gated_delta_net_spec(impls: Mapping[str, str] | None = None, impl: str = "auto") -> ModuleSpec:
    """The spec of :class:`RegistryGatedDeltaNet`: local linears, a plain-weight registry RMSNorm
    as the gated output norm (also in models whose other norms are zero-centred), the
    ``gated_delta_rule`` kernel ``impl``."""
    provider = MindSpeedSpecProvider(impls)
    norm = ModuleSpec(module=RegistryNorm, params={"impl": provider.impls["rms_norm"], "zero_centered": False})
    return ModuleSpec(
        module=RegistryGatedDeltaNet,
        params={"impl": impl},
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear),
        metainfo={"fuse_input_layernorm": False},
    )
