"""The call sites of megatron-core's training step that name CUDA, fixed where they are.

The device redirect (a torch function mode) sees every torch call: ~1,300 Python hops per
step of the tiny GPT. The training step (forward, backward, optimizer step) runs without it
(:func:`mindspeed.megatron.fast_path`); what it needs instead is here, each a version-checked,
reversible :class:`~mindspeed.patching.UpstreamPatch`:

- the modules of the step that create tensors with ``device="cuda"`` get a
  :class:`~mindspeed.device.cuda_shim.DeviceMappedTorch` as their ``torch`` global (the
  factories map the device; everything else is ``torch`` itself);
- the gradient norm and clipping: megatron's fallbacks without Apex/TE loop over tensors in
  Python and sync with the host for the norm (``float(l2)``); ours are ``torch._foreach_*``
  calls that stay on the device (same sums: the norm is that of the per-tensor norms);
- ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() == "torch.cuda.FloatTensor"``,
  which only the redirect made true off CUDA: ours checks the dtype.

Setup (model build, optimizer construction, checkpoints) still runs under the redirect that
``adapt()`` enters: it runs once, and megatron-core checks parameter types by their CUDA names
there (``param.type() == "torch.cuda.FloatTensor"``) in code that has no seam.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed.device.cuda_shim import SHIMMED_ACCELERATORS, DeviceMappedTorch
from mindspeed.patching import UpstreamPatch

#: megatron-core versions these sites were read in (the adaptor's range).
SITE_VERSIONS = ">=0.16.0,<0.17"

#: Modules of the training step with ``device="cuda"`` tensor factories, and where.
DEVICE_SITE_MODULES = {
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens of every schedule",
    "megatron.core.optimizer.clip_grads": "get_grad_norm_fp32 / count_zeros_fp32 buffers",
    "megatron.core.transformer.utils": "get_default_causal_mask (megatron's softmax, local spec)",
    "megatron.core.transformer.moe.moe_utils": "the MoE aux-loss tracker",
    "megatron.core.rerun_state_machine": "_reduce_any of the rerun state machine",
}


def _without_apex_or_te() -> bool:
    from megatron.core.optimizer import clip_grads

    return clip_grads.multi_tensor_applier.__module__.startswith("megatron.")


def _foreach_l2_norm(original: Any, acc: Any) -> Any:
    def l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
        # One kernel for all per-tensor norms, and the total stays on the device (upstream's
        # fallback loops over tensors and reads the norm back to the host).
        norms = torch._foreach_norm(tensor_lists[0])
        total = torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1)
        return total, None

    return l2_norm


def _foreach_scale(original: Any, acc: Any) -> Any:
    def scale(chunk_size: int, noop_flag: Any, tensor_lists: list, factor: float) -> None:
        source, target = tensor_lists
        if all(a is b for a, b in zip(source, target)):
            torch._foreach_mul_(target, factor)
        else:  # dst.copy_(src * scale), as upstream, for all tensors at once
            torch._foreach_copy_(target, torch._foreach_mul(source, factor))

    return scale


def _clip_by_total_norm(original: Any, acc: Any) -> Any:
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        # Upstream asserts param.grad.type() == "torch.cuda.FloatTensor": the dtype is what matters.
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is None:
                continue
            allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
            if grad.dtype not in allowed:
                raise TypeError(f"gradient clipping expects {allowed} gradients, got {grad.dtype}")
            grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
            clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, overflow, [grads, grads], clip_coeff)

    return clip_grad_by_total_norm_fp32


def _pos_emb_on_cp_rank(original: Any, acc: Any) -> Any:
    def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        # Upstream builds the chunk indices in pinned host memory and moves them with .cuda();
        # they are built where the embedding is. Chunks r and 2C - 1 - r of 2C, as upstream.
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])

    return get_pos_emb_on_this_cp_rank


def device_site_patches() -> list[UpstreamPatch]:
    """The patches that let megatron-core's training step run without the device redirect."""
    common = dict(distribution="megatron-core", versions=SITE_VERSIONS)
    patches = [
        UpstreamPatch(
            f"cuda-site:{module.rsplit('.', 1)[1]}",
            f"{module}.torch",
            lambda original, acc: DeviceMappedTorch(acc),
            reason=f"device='cuda' tensor factories: {where}",
            accelerators=SHIMMED_ACCELERATORS,
            **common,
        )
        for module, where in DEVICE_SITE_MODULES.items()
    ]
    embeddings = "megatron.core.models.common.embeddings"
    patches += [
        UpstreamPatch(
            f"cp-rope-slice:{module}",
            f"{embeddings}.{module}.get_pos_emb_on_this_cp_rank",
            _pos_emb_on_cp_rank,
            reason="context parallelism's rope slice moves its indices with .cuda() (imported by name)",
            accelerators=SHIMMED_ACCELERATORS,
            **common,
        )
        for module in ("rope_utils", "rotary_pos_embedding", "yarn_rotary_pos_embedding")
    ]
    clip = "megatron.core.optimizer.clip_grads"
    patches += [
        UpstreamPatch(
            "foreach-grad-norm",
            f"{clip}.l2_norm_impl",
            _foreach_l2_norm,
            condition=_without_apex_or_te,
            reason="without Apex/TE the l2 norm loops over tensors and syncs with the host (float(l2))",
            **common,
        ),
        UpstreamPatch(
            "foreach-grad-scale",
            f"{clip}.multi_tensor_scale_impl",
            _foreach_scale,
            condition=_without_apex_or_te,
            reason="without Apex/TE gradient clipping scales one tensor at a time",
            **common,
        ),
        UpstreamPatch(
            "foreach-copy",
            "megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
            _foreach_scale,
            condition=_without_apex_or_te,
            reason="without Apex/TE the fp16/bf16 optimizer copies main to model params one tensor at a time",
            **common,
        ),
    ]
    patches += [
        UpstreamPatch(
            f"clip-grad-dtype{suffix}",
            f"{module}.clip_grad_by_total_norm_fp32",
            _clip_by_total_norm,
            reason="asserts param.grad.type() == 'torch.cuda.FloatTensor' (true off CUDA only under the redirect)",
            accelerators=SHIMMED_ACCELERATORS,
            **common,
        )
        for suffix, module in (("", clip), ("-optimizer", "megatron.core.optimizer.optimizer"))
    ]
    return patches
