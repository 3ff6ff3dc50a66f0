"""megatron-core MoE on the kernel registry: grouped-matmul experts and fused token permutation.

- :class:`RegistryGroupedMLP` is a drop-in for megatron's ``GroupedMLP`` / ``TEGroupedMLP``
  (the ``experts`` module of an ``MoELayer``): one ``grouped_matmul`` per projection over all
  local experts and the registry ``swiglu``, with no Transformer Engine and no
  ``grouped_gemm`` package. Its weights are laid out exactly as ``GroupedMLP``'s, so megatron's
  ``sharded_state_dict`` (shared with ``SequentialMLP`` checkpoints) applies unchanged.
- :func:`moe_permute_patches` routes the token dispatchers' ``permute`` / ``unpermute`` to the
  registry's ``moe_permute`` / ``moe_unpermute`` kernels (``adapt()`` adds them when the
  ``moe_permute_fusion`` feature is on).
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import build_module

from mindspeed.device import get_accelerator
from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.ops import resolve_kernel
from mindspeed.ops.moe_permute import permuted_probs_of
from mindspeed.patching import UpstreamPatch


class RegistryGroupedMLP(MegatronModule):
    """The experts of an ``MoELayer`` as two grouped matmuls (fc1, fc2) over all local experts.

    Same constructor and forward contract as megatron's ``GroupedMLP`` / ``TEGroupedMLP``:
    ``forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs) -> (output, None)``
    with tokens grouped by local expert and each expert's activation scaled by its routing
    probability before fc2. Weights as in ``GroupedMLP``: ``weight1`` holds
    ``[experts, hidden, fc1_out]`` in a ``[hidden, experts * fc1_out]`` parameter (per expert
    ``[gate_r | up_r]`` for a gated unit on expert-tensor-parallel rank ``r``), ``weight2``
    holds ``[experts, ffn, hidden]`` in an ``[experts * ffn, hidden]`` parameter.

    Args:
        num_local_experts: experts on this expert-parallel rank.
        config: the ``TransformerConfig`` (``moe_ffn_hidden_size``, ``gated_linear_unit``,
            ``activation_func``; no linear bias, no latent projection, no fp8/fp4).
        submodules: optional ``MLPSubmodules`` whose ``activation_func`` spec builds the gated
            activation (as for ``TEGroupedMLP``); linear submodules are ignored.
        pg_collection: megatron's process groups (``ep``, ``expt_tp``, ``expt_dp``).
        impl: ``grouped_matmul`` implementation (``None``: "auto"); the spec passes its kernels' choice.
        swiglu_impl: ``swiglu`` implementation when no activation submodule is given (``None``: "auto").

    Raises:
        ValueError: for a config this module does not support, naming the field.
    """

    #: megatron's own mapping of these weights to per-expert checkpoint shards (compatible with
    #: SequentialMLP); it reads only the attributes set in __init__ below.
    sharded_state_dict = GroupedMLP.sharded_state_dict

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        impl: str | None = None,
        swiglu_impl: str | None = None,
    ) -> None:
        super().__init__(config=config)
        _check_config(config)
        self.num_local_experts = num_local_experts
        self.expert_parallel = config.expert_model_parallel_size > 1
        pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        self.kernel = resolve_kernel("grouped_matmul", impl or "auto")
        self.activation_func = self._build_activation(config, submodules, swiglu_impl)
        self.activation_recompute = (
            config.recompute_granularity == "selective" and "moe_act" in config.recompute_modules
        )
        self._make_weights(config)
        # Checkpoints written by SequentialMLP carry per-expert _extra_state entries.
        self.register_load_state_dict_post_hook(_ignore_extra_state)

    @staticmethod
    def _build_activation(config: Any, submodules: Any, swiglu_impl: str | None) -> Any:
        if not config.gated_linear_unit:
            return config.activation_func
        spec = getattr(submodules, "activation_func", None)
        if spec is not None:
            return build_module(spec, config=config)
        if config.activation_func is F.silu:
            return resolve_kernel("swiglu", swiglu_impl or "auto")

        def glu(x: torch.Tensor) -> torch.Tensor:
            gate, up = torch.chunk(x, 2, dim=-1)
            return config.activation_func(gate) * up

        return glu

    def _make_weights(self, config: Any) -> None:
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        fc1_size = config.moe_ffn_hidden_size * self.num_local_experts * (2 if config.gated_linear_unit else 1)
        fc2_size = config.moe_ffn_hidden_size * self.num_local_experts
        fc1_local, fc2_local = divide(fc1_size, tp_size), divide(fc2_size, tp_size)
        # As GroupedMLP (same shapes, same initialisation and RNG use), so a model initialises
        # identically with either module.
        device = None if config.use_cpu_initialization else get_accelerator().current_device()
        self.weight1 = torch.nn.Parameter(
            torch.empty(config.hidden_size, fc1_local, device=device, dtype=config.params_dtype)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(fc2_local, config.hidden_size, device=device, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            if config.use_cpu_initialization:
                _initialize_affine_weight_cpu(
                    self.weight1,
                    config.hidden_size,
                    fc1_size,
                    fc1_local,
                    partition_dim=1,
                    init_method=config.init_method,
                    params_dtype=config.params_dtype,
                    rank=tp_rank,
                    world_size=tp_size,
                )
                _initialize_affine_weight_cpu(
                    self.weight2,
                    fc2_size,
                    config.hidden_size,
                    fc2_local,
                    partition_dim=0,
                    init_method=config.output_layer_init_method,
                    params_dtype=config.params_dtype,
                    rank=tp_rank,
                    world_size=tp_size,
                )
            else:
                _initialize_affine_weight_gpu(self.weight1, config.init_method, partition_dim=1, is_expert=True)
                _initialize_affine_weight_gpu(
                    self.weight2, config.output_layer_init_method, partition_dim=0, is_expert=True
                )
        for weight, dim in ((self.weight1, 1), (self.weight2, 0)):
            if not hasattr(weight, "tensor_model_parallel"):
                # Without initialisation upstream leaves them unset, and the gradient norm then
                # takes expert weights of tensor-parallel rank > 0 for duplicates.
                set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
            weight.allreduce = not self.expert_parallel  # DDP reduces expert-parallel weights over expt_dp

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """Experts' output for tokens grouped by local expert.

        Args:
            permuted_local_hidden_states: ``[tokens, hidden]``, expert 0's tokens first.
            tokens_per_expert: int ``[num_local_experts]`` row counts.
            permuted_probs: ``[tokens]`` routing probability of every row.

        Returns:
            ``([tokens, hidden], None)`` (no bias).
        """
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input needs moe_router_topk=1")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        hidden = self.config.hidden_size
        if x.nelement() == 0:
            # No token for any local expert: a plain matmul still gives every weight a (zero)
            # gradient, which DDP's gradient hooks and bucket accounting rely on.
            w1, w2 = self.weight1.view(hidden, -1), self.weight2.view(-1, hidden)
            return torch.matmul(self._activate(torch.matmul(x, w1), probs), w2), None
        w1 = self.weight1.view(self.num_local_experts, hidden, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, hidden)
        fc1 = self.kernel(x, w1, tokens_per_expert)
        if self.activation_recompute:
            # fp8=None: upstream stores ``fp8 is not None``, so the default (False) would take
            # the Transformer Engine path (NameError without TE); None means no fp8 either way.
            checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
            act = checkpoint.checkpoint(self._activate, fc1, probs)
            out = self.kernel(act, w2, tokens_per_expert)
            checkpoint.discard_output_and_register_recompute(out)
            return out, None
        return self.kernel(self._activate(fc1, probs), w2, tokens_per_expert), None

    def _activate(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        # Scaled by the probability in the activation's dtype, as megatron's experts do.
        return (self.activation_func(fc1) * probs.unsqueeze(-1)).to(fc1.dtype)

    def backward_dw(self) -> None:
        """Nothing is deferred (megatron calls it on every experts module)."""


def _check_config(config: Any) -> None:
    if config.add_bias_linear:
        raise ValueError("RegistryGroupedMLP has no expert bias; set TransformerConfig(add_bias_linear=False)")
    if getattr(config, "moe_latent_size", None):
        raise ValueError("RegistryGroupedMLP does not support moe_latent_size; leave it None")
    if config.fp8 or getattr(config, "fp4", None):
        raise ValueError("RegistryGroupedMLP computes in the parameter dtype; fp8/fp4 need TEGroupedMLP")
    if config.gated_linear_unit and config.activation_func not in (F.silu, F.gelu):
        raise ValueError("a gated RegistryGroupedMLP needs activation_func F.silu (SwiGLU) or F.gelu (GeGLU)")


def _ignore_extra_state(module: torch.nn.Module, incompatible_keys: Any) -> None:
    for key in deepcopy(incompatible_keys.unexpected_keys):
        if "_extra_state" in key:
            incompatible_keys.unexpected_keys.remove(key)


# -- fused token permutation ----------------------------------------------------------------------


def _permute(original: Any, acc: Any, impl: str) -> Any:
    kernel = resolve_kernel("moe_permute", impl)

    def permute(
        tokens: torch.Tensor,
        routing_map: torch.Tensor,
        probs: torch.Tensor | None = None,
        num_out_tokens: Any = None,
        fused: bool = False,
        drop_and_pad: bool = False,
    ) -> tuple:
        if drop_and_pad:
            # Capacity-padded routing keeps megatron's argsort path (fixed shapes for graphs).
            return original(
                tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused, drop_and_pad=drop_and_pad
            )
        permuted, sorted_indices = kernel(tokens, routing_map, num_out_tokens)
        permuted_probs = None if probs is None else permuted_probs_of(probs, routing_map)
        return permuted, permuted_probs, sorted_indices

    return permute


def _unpermute(original: Any, acc: Any, impl: str) -> Any:
    kernel = resolve_kernel("moe_unpermute", impl)

    def unpermute(
        permuted_tokens: torch.Tensor,
        sorted_indices: torch.Tensor,
        restore_shape: Sequence[int],
        probs: torch.Tensor | None = None,
        routing_map: torch.Tensor | None = None,
        fused: bool = False,
        drop_and_pad: bool = False,
    ) -> torch.Tensor:
        if drop_and_pad:
            return original(
                permuted_tokens,
                sorted_indices,
                restore_shape,
                probs=probs,
                routing_map=routing_map,
                fused=fused,
                drop_and_pad=drop_and_pad,
            )
        return kernel(permuted_tokens, sorted_indices, restore_shape, probs, routing_map if probs is not None else None)

    return unpermute


def moe_permute_patches(permute_impl: str = "auto", unpermute_impl: str = "auto") -> list[UpstreamPatch]:
    """Patches routing megatron's token-dispatcher permutation to the registry kernels.

    ``megatron.core.transformer.moe.token_dispatcher`` imports ``permute`` and ``unpermute`` by
    name from ``moe_utils``; both dispatchers call them there (alltoall with probabilities,
    allgather without), so the dispatcher module's names are replaced. Capacity-padded routing
    (``drop_and_pad``) stays on megatron's implementation. ``config.moe_permute_fusion`` is
    left off: it would send megatron to Transformer Engine's kernels.

    Args:
        permute_impl: implementation of ``moe_permute``.
        unpermute_impl: implementation of ``moe_unpermute``.
    """
    common = dict(
        distribution="megatron-core",
        versions=MEGATRON_VERSIONS,
        reason="the token dispatchers import permute/unpermute by name from moe_utils; the fused "
        "path needs Transformer Engine",
    )
    return [
        UpstreamPatch(
            "moe-permute-kernel",
            "megatron.core.transformer.moe.token_dispatcher.permute",
            lambda original, acc: _permute(original, acc, permute_impl),
            **common,
        ),
        UpstreamPatch(
            "moe-unpermute-kernel",
            "megatron.core.transformer.moe.token_dispatcher.unpermute",
            lambda original, acc: _unpermute(original, acc, unpermute_impl),
            **common,
        ),
    ]
