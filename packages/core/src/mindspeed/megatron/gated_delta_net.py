"""megatron-core's Gated DeltaNet layer (``megatron.core.ssm.gated_delta_net``) on the kernel registry.

megatron-core 0.16's ``GatedDeltaNet`` (Qwen3-Next's linear-attention layer) calls
flash-linear-attention by module-level names: ``chunk_gated_delta_rule`` for the recurrence and
``l2norm`` for queries and keys, and its constructor refuses to build when FLA is missing
(``HAVE_FLA``). The kernel has no spec seam, so :func:`gated_delta_net_patches` binds those
names to the registry's ``gated_delta_rule`` (``impl``: ``"auto"`` is FLA itself on CUDA where it
is installed, the chunked reference elsewhere) and to FLA's l2norm definition. The layer's
linear layers and output norm do have a seam: :func:`get_gated_delta_net_spec` builds them
from megatron's local linears and the registry norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mindspeed.device.cuda_shim import SHIMMED_ACCELERATORS
from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.megatron.spec import MindSpeedSpecProvider
from mindspeed.ops import resolve_kernel
from mindspeed.ops.gated_delta_rule import l2norm
from mindspeed.patching import UpstreamPatch

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
        UpstreamPatch(
            name="gdn-have-fla",
            target=f"{_GDN}.HAVE_FLA",
            make=lambda original, acc: True,
            reason="GatedDeltaNet's constructor refuses to build without FLA; its kernel is bound above",
            **common,
        ),
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
