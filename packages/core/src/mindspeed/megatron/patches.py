"""Patches of megatron-core where it has no seam, each version-checked and reversible.

Every patch names the megatron-core versions it was written for; ``adapt()`` refuses to run
on a version outside the range rather than patch code it has not been checked against.
The ``torch.cuda`` redirects themselves live in ``mindspeed.device.cuda_shim``.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import numpy as np
import torch

from mindspeed.device.cuda_shim import SHIMMED_ACCELERATORS
from mindspeed.patching import UpstreamPatch

#: megatron-core versions the adaptor is written and tested for (also pinned in pyproject).
MEGATRON_VERSIONS = ">=0.16.0,<0.17"
_NOT_CUDA = SHIMMED_ACCELERATORS


def _te_missing() -> bool:
    return importlib.util.find_spec("transformer_engine") is None


def _token_position_preprocess(original: Any, acc: Any) -> Any:
    # Lazy: the module imports megatron-core, which importing the adaptor must not do.
    from mindspeed.megatron.shared_prefix import token_position_preprocess

    return token_position_preprocess(original, acc)


def _rng_get(original: Any, acc: Any) -> Any:
    def get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return acc.get_rng_state()

    return get_rng_state


def _rng_set(original: Any, acc: Any) -> Any:
    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        acc.set_rng_state(new_state)

    return set_rng_state


def _move_to_cpu(original: Any, acc: Any) -> Any:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # Upstream only moves tensors whose .is_cuda is true, so split sizes on any other device
        # (or already on the host) stay tensors and all_to_all_single rejects them.
        if not torch.is_tensor(tensor):
            return tensor
        host = tensor.detach().to("cpu") if tensor.device.type != "cpu" else tensor.detach()
        return host.numpy() if as_numpy else host

    return maybe_move_tensor_to_cpu


def _norm_with_sequence_parallel(original: Any, acc: Any) -> Any:
    def __new__(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        # torch's norms are token-wise, so they are correct on sequence-parallel shards; only the
        # gradient of their weights must be all-reduced over TP, which the tag asks for.
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def _optimizer_state_keys(original: Any, acc: Any) -> Any:
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> None:
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        # torch.optim.Adam keeps a "step" entry that the checkpoint's tensors do not carry.
        for key, value in tensors.items():
            if key in targets:
                targets[key].copy_(value)
        return None

    return _set_main_param_and_optimizer_states


def _p2p_same_peer_order(original: Any, acc: Any) -> Any:
    def _batched_p2p_ops(
        *,
        tensor_send_prev: Any,
        tensor_recv_prev: Any,
        tensor_send_next: Any,
        tensor_recv_next: Any,
        group: Any,
        prev_pipeline_rank: int,
        next_pipeline_rank: int,
    ) -> list:
        if prev_pipeline_rank != next_pipeline_rank:
            return original(
                tensor_send_prev=tensor_send_prev,
                tensor_recv_prev=tensor_recv_prev,
                tensor_send_next=tensor_send_next,
                tensor_recv_next=tensor_recv_next,
                group=group,
                prev_pipeline_rank=prev_pipeline_rank,
                next_pipeline_rank=next_pipeline_rank,
            )
        # Pipeline size 2: the previous and the next stage are one peer, and messages between two
        # ranks pair up in the order they are posted (gloo and NCCL alike). Upstream posts
        # send_prev before send_next on both ranks, so the interleaved schedule's gradient lands in
        # the peer's activation buffer (same shape: no error, wrong numbers). Sending next-then-prev
        # and receiving prev-then-next pairs each send_next with the peer's recv_prev.
        import torch.distributed as dist

        ops = [
            dist.P2POp(op, tensor, peer, group)
            for op, tensor, peer in (
                (dist.isend, tensor_send_next, next_pipeline_rank),
                (dist.irecv, tensor_recv_prev, prev_pipeline_rank),
                (dist.isend, tensor_send_prev, prev_pipeline_rank),
                (dist.irecv, tensor_recv_next, next_pipeline_rank),
            )
            if tensor is not None
        ]
        return dist.batch_isend_irecv(ops) if ops else []

    return _batched_p2p_ops


def _optimizer_state_dict_fresh(original: Any, acc: Any) -> Any:
    def state_dict(self: Any) -> dict:
        # Without Apex/TE, upstream reads Adam's step from the per-parameter state and asserts
        # there is exactly one value; a fresh torch.optim.Adam has none (it creates "step" on its
        # first step, and megatron's init_state_fn does not), so building the template to load
        # a checkpoint into a new optimizer fails. Same result otherwise, with step 0 when fresh.
        inner = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in inner["state"].values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(f"parameters of one optimizer are at different steps: {sorted(steps)}")
        step = steps.pop() if steps else 0.0
        result: dict = {"optimizer": {key: value for key, value in inner.items() if key != "state"}}
        for group in result["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = step
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    return state_dict


def _optimizer_unshared_steps(original: Any, acc: Any) -> Any:
    def load_state_dict(self: Any, state_dict: dict) -> None:
        original(self, state_dict)
        # Without Apex/TE, upstream puts one and the same "step" tensor into every parameter's
        # torch.optim.Adam state; Adam increments each parameter's step in place, so after a
        # load the n-th parameter updated with step + n and wrong bias corrections.
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    return load_state_dict


def _is_gloo(group: Any) -> bool:
    return torch.distributed.get_backend(group) == "gloo"


def _gather_uneven_on_gloo(original: Any, acc: Any) -> Any:
    def _gather_along_first_dim(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return original(input_, group, output_split_sizes, use_global_buffer)
        # gloo's all_gather takes equal sizes only: pad every piece to the longest, then trim.
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, output_split_sizes)])

    return _gather_along_first_dim


def _reduce_scatter_uneven_on_gloo(original: Any, acc: Any) -> Any:
    def _reduce_scatter_along_first_dim(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return original(input_, group, input_split_sizes, use_global_buffer)
        # gloo has no list reduce_scatter: sum the whole tensor, keep this rank's rows.
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].contiguous()

    return _reduce_scatter_along_first_dim


def _reset_only_moe_tensors(original: Any, acc: Any) -> Any:
    def reset_model_temporary_tensors(config: Any, model: list) -> None:
        # Upstream walks every module of every chunk after each step to reset MoE routers' token
        # counts and global aux-loss trackers; a model without either has nothing to reset.
        balancing = config.moe_router_load_balancing_type or ()
        if config.moe_router_enable_expert_bias or "global_aux_loss" in balancing:
            original(config, model)

    return reset_model_temporary_tensors


def _without_apex_or_te() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def megatron_patches() -> list[UpstreamPatch]:
    """The megatron-core patches, in the order they are applied."""
    common = dict(distribution="megatron-core", versions=MEGATRON_VERSIONS)
    return [
        UpstreamPatch(
            "rng-get",
            "megatron.core.tensor_parallel.random._get_cuda_rng_state",
            _rng_get,
            reason="reads the CUDA default generators",
            accelerators=_NOT_CUDA,
            **common,
        ),
        UpstreamPatch(
            "rng-set",
            "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            _rng_set,
            reason="writes the CUDA default generators through a lazy CUDA call",
            accelerators=_NOT_CUDA,
            **common,
        ),
        UpstreamPatch(
            "moe-splits-to-host",
            "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
            _move_to_cpu,
            reason="only converts tensors with .is_cuda",
            accelerators=_NOT_CUDA,
            **common,
        ),
        UpstreamPatch(
            "moe-splits-to-host-dispatcher",
            "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
            _move_to_cpu,
            reason="imported by name from moe_utils",
            accelerators=_NOT_CUDA,
            **common,
        ),
        UpstreamPatch(
            "te-general-gemm-undefined",
            "megatron.core.transformer.moe.moe_utils.te_general_gemm",
            lambda original, acc: None,
            allow_missing=True,
            condition=lambda: _te_missing() and not _has_te_general_gemm(),
            reason="upstream bug: the router reads te_general_gemm, defined only when "
            "Transformer Engine imports (NameError otherwise)",
            **common,
        ),
        UpstreamPatch(
            "torch-norm-sequence-parallel",
            "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
            _norm_with_sequence_parallel,
            reason="asserts 'sequence parallel not supported by torch LayerNorm' although token-wise "
            "norms are correct on sequence shards",
            **common,
        ),
        UpstreamPatch(
            "distopt-state-keys",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
            _optimizer_state_keys,
            condition=_without_apex_or_te,
            reason="upstream bug without Apex/TE: KeyError 'step' when loading a fully_reshardable "
            "checkpoint into torch.optim.Adam state",
            **common,
        ),
        UpstreamPatch(
            "distopt-fresh-state-dict",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
            _optimizer_state_dict_fresh,
            condition=_without_apex_or_te,
            reason="upstream bug without Apex/TE: AssertionError (len(steps) == 1) in state_dict() of a "
            "DistributedOptimizer that has not stepped, e.g. when loading a checkpoint into it",
            **common,
        ),
        UpstreamPatch(
            "distopt-unshared-steps",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
            _optimizer_unshared_steps,
            condition=_without_apex_or_te,
            reason="upstream bug without Apex/TE: load_state_dict gives all parameters one shared Adam "
            "step tensor, which every parameter's update increments (wrong bias correction after a load)",
            **common,
        ),
        UpstreamPatch(
            "gloo-uneven-all-gather",
            "megatron.core.tensor_parallel.mappings._gather_along_first_dim",
            _gather_uneven_on_gloo,
            reason="gloo's all_gather takes equal sizes only; the MoE alltoall dispatcher gathers uneven "
            "token counts over the expert tensor-parallel group ('invalid tensor size')",
            **common,
        ),
        UpstreamPatch(
            "gloo-uneven-reduce-scatter",
            "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
            _reduce_scatter_uneven_on_gloo,
            reason="gloo has no reduce_scatter of a tensor list; the MoE alltoall dispatcher's backward "
            "scatters uneven token counts",
            **common,
        ),
        UpstreamPatch(
            "reset-temporaries-moe-only",
            "megatron.core.distributed.finalize_model_grads.reset_model_temporary_tensors",
            _reset_only_moe_tensors,
            reason="walks every module after each step (~500 module visits of a 4-layer GPT) although only "
            "MoE routers with expert bias or a global aux loss have anything to reset",
            **common,
        ),
        UpstreamPatch(
            "rope-token-positions",
            "megatron.core.models.gpt.gpt_model.GPTModel._preprocess",
            _token_position_preprocess,
            reason="megatron's THD rope numbers positions per cu_seqlens segment; shared-prefix packing "
            "(a prompt once, then its responses) needs each response's positions to continue from its prompt",
            **common,
        ),
        UpstreamPatch(
            "p2p-same-peer-order",
            "megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops",
            _p2p_same_peer_order,
            reason="upstream bug (Megatron-LM issues 750, 1450): with pipeline size 2 and the interleaved "
            "schedule, batch_p2p_comm crosses activations and gradients between the two stages",
            **common,
        ),
    ]


def _has_te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return hasattr(moe_utils, "te_general_gemm")


__all__ = ["MEGATRON_VERSIONS", "megatron_patches", "np"]
