"""FSDP2 for a Hugging Face model: the data-parallel mesh, wrapping plans by module-name pattern, recompute.

The mesh comes from the accelerator seam (gloo ranks on the CPU, one device per rank
elsewhere): ``(dp_shard,)``, or ``(dp_replicate, dp_shard)`` for HSDP; sequence-parallel
ranks belong to the shard axis, and their Ulysses groups come from the ``(dp, sp)`` mesh. A plan is a list of
module-name patterns (MindSpeed-MM's ``fsdp_plan.apply_modules``: ``{*}`` or ``*`` matches one
name part); every matching module becomes one FSDP2 unit, innermost first, then the root,
which holds what is left (embeddings and head, so tied weights stay in one unit).
Activation checkpointing wraps the forward of matching modules in
``torch.utils.checkpoint`` (non-reentrant) in place, so parameter names, checkpoints and
exports are unchanged.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.memory.swap_attention import SwapAttention

logger = get_logger(__name__)


def build_mesh(world_size: int, dp_replicate: int = 1, sp: int = 1) -> DeviceMesh:
    """The FSDP2 mesh of ``world_size`` ranks on the accelerator's device type.

    Parameters are sharded over every rank of a replica, sequence-parallel ranks included (they
    hold the same parameters and each computes a part of every gradient): ``(dp_shard,)``, or
    ``(dp_replicate, dp_shard)`` for HSDP, where ``dp_shard`` spans ``world_size / dp_replicate``
    ranks (named ``dp_shard_sp`` when ``sp > 1``).
    """
    device_type = get_accelerator().device().type
    shard = "dp_shard_sp" if sp > 1 else "dp_shard"
    if dp_replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=(shard,))
    return init_device_mesh(
        device_type, (dp_replicate, world_size // dp_replicate), mesh_dim_names=("dp_replicate", shard)
    )


def build_sp_mesh(world_size: int, sp: int) -> DeviceMesh:
    """The ``(dp, sp)`` mesh: consecutive ranks form a sequence-parallel (Ulysses) group, ``mesh["sp"]``."""
    return init_device_mesh(get_accelerator().device().type, (world_size // sp, sp), mesh_dim_names=("dp", "sp"))


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A module-name pattern as a regular expression: ``{*}`` and ``*`` match one dotted name part."""
    parts = [re.escape(part).replace(r"\{\*\}", "[^.]+").replace(r"\*", "[^.]+") for part in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def match_modules(
    model: torch.nn.Module, patterns: list[str] | tuple[str, ...], what: str
) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module matching a pattern, deepest first.

    Raises:
        ValueError: a pattern that matches no module (naming ``what`` it was for).
    """
    names = [(name, module) for name, module in model.named_modules() if name]
    matched: dict[str, torch.nn.Module] = {}
    for pattern in patterns:
        regex = pattern_regex(pattern)
        hits = [(name, module) for name, module in names if regex.match(name)]
        if not hits:
            example = next((n for n, _ in names if n.count(".") == 2), names[0][0])
            raise ValueError(
                f"{what}: pattern {pattern!r} matches no module of {type(model).__name__}; module "
                f"names look like {example!r} ({{*}} matches one part)"
            )
        matched.update(hits)
    return sorted(matched.items(), key=lambda item: -item[0].count("."))


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy: bf16 compute parameters with fp32 gradient reduction, or None for fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def needs_fsdp(world_size: int, precision: str) -> bool:
    """Whether the model is wrapped with FSDP2: always but for one rank in fp32.

    One fp32 rank has nothing to shard, gather or reduce, and FSDP2 would still copy every
    parameter into its all-gather buffer before the forward and the backward and every
    gradient through its reduce-scatter buffer (about 10-15% of a step on the CPU,
    tools/bench/vlm.py). Without it the parameters train in place and gradients accumulate
    in ``.grad``: the same sums in the same order, so the run is the same. bf16 keeps FSDP2
    at one rank too: its mixed-precision policy is what casts the compute copies.
    """
    return world_size > 1 or precision != "fp32"


def apply_fsdp(
    model: torch.nn.Module,
    plan: list[str] | tuple[str, ...],
    mesh: DeviceMesh,
    precision: str,
    reshard_after_forward: bool = True,
) -> list[str]:
    """Shard ``model`` in place: one FSDP2 unit per module matching ``plan`` (innermost first), then the root.

    Returns:
        The wrapped module names (the root last, as ``""``).
    """
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(precision)
    units = match_modules(model, plan, "parallel.fsdp_plan")
    for _, module in units:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    logger.info(
        "FSDP2: %d units over mesh %s (%s), precision %s",
        len(units) + 1,
        tuple(mesh.shape),
        ", ".join(mesh.mesh_dim_names or ()),
        precision,
    )
    return [name for name, _ in units] + [""]


def load_from_rank0(
    model: torch.nn.Module,
    full_state: dict[str, torch.Tensor] | None,
    buffers: dict[str, torch.Tensor] | None,
    device: torch.device,
) -> None:
    """Fill a sharded model built on the meta device with rank 0's weights and buffers (a collective).

    Rank 0 passes its full state dict and named buffers (buffers such as rotary frequencies are in
    no checkpoint); the other ranks pass None and receive only their shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(
        model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for name, buffer in model.named_buffers():
        if buffers is not None:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Recompute the activations of every module matching ``patterns`` in the backward; returns their names."""
    if not patterns:
        return []
    matched = match_modules(model, patterns, "train.recompute_modules")
    names = {name for name, _ in matched}
    for name, module in matched:
        if any(name.startswith(other + ".") for other in names):
            continue  # inside a module that is recomputed as a whole already
        module.forward = functools.partial(_checkpointed, module.forward)
    logger.info("recompute: %d modules (%s)", len(matched), ", ".join(patterns))
    return sorted(names)


def apply_swap(model: torch.nn.Module, patterns: list[str], recomputed: list[str] = ()) -> SwapAttention | None:
    """Swap the saved activations of every module matching ``patterns`` to host memory (outermost
    matches; in forward order, which is registration order for these models).

    Args:
        model: the model, before FSDP wraps it.
        patterns: ``train.swap_modules``.
        recomputed: the modules :func:`apply_recompute` checkpointed (their activations are
            recomputed, not saved: swapping them too is refused).

    Raises:
        ValueError: a pattern that matches nothing, or a module also recomputed.
    """
    if not patterns:
        return None
    matched = match_modules(model, patterns, "train.swap_modules")
    names = {name for name, _ in matched}
    outer = [(n, m) for n, m in matched if not any(n.startswith(other + ".") for other in names)]
    # A module inside a recomputed one saves nothing to swap (a recomputed module inside a
    # swapped one is fine: its checkpoint's inputs are swapped).
    both = sorted(n for n, _ in outer if any(n == r or n.startswith(r + ".") for r in recomputed))
    if both:
        raise ValueError(
            f"train.swap_modules and train.recompute_modules both take {both[0]} (and {len(both) - 1} more); "
            "recompute a module or swap it, not both"
        )
    order = {id(module): index for index, module in enumerate(model.modules())}
    modules = sorted((module for _, module in outer), key=lambda module: order[id(module)])
    return SwapAttention().install_modules(modules)
