"""megatron's optimizer step run over chunks of its parameters, with work before and after each chunk.

fp32-master reuse and optimizer swap both keep the optimizer's fp32 state out of device memory
between steps and bring it back only for the step, one chunk of parameters at a time. Both
need the same two things from megatron's ``MixedPrecisionOptimizer`` / ``DistributedOptimizer``:

- :func:`master_pairs`: each fp32 main parameter with the 16-bit model tensor it is copied to
  after the step (the whole parameter, or with the distributed optimizer this rank's shard of
  the parameter buffer, exactly the slice megatron's ``_copy_main_params_to_model_params``
  writes); ``model`` is ``None`` where the main parameter is the model's own fp32 tensor.
- :class:`ChunkedStep`: the inner torch optimizer's ``step()`` run chunk by chunk (each
  parameter group restricted to the chunk's parameters; Adam's update is per parameter, so the
  numbers are those of one step over all), with ``before(chunk)`` / ``after(chunk)`` around each.
  The main -> model copy moves into the chunk loop (``after`` runs it, with megatron's own cast),
  and megatron's whole-model copy after the inner step becomes a no-op, so a chunk's fp32 state
  can leave the device as soon as its chunk is done.

Everything is done on instances (the optimizer's inner ``step`` and ``_copy_main_params_to_model_params``
attributes); :meth:`ChunkedStep.remove` restores them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MasterPair:
    """An fp32 main parameter of the optimizer and where the step writes its 16-bit copy.

    Attributes:
        main: the fp32 parameter the inner torch optimizer updates.
        model: the model tensor of the same number of elements (1-D shard or whole parameter)
            that megatron copies ``main`` into after the step; ``None`` when ``main`` is the
            model's own fp32 parameter (fp32 training).
    """

    main: torch.nn.Parameter
    model: torch.Tensor | None

    @property
    def numel(self) -> int:
        """Elements of the main parameter."""
        return self.main.numel()


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer`` or one optimizer)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer: Any) -> bool:
    """Whether every megatron optimizer in ``optimizer`` is a ``DistributedOptimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = sub_optimizers(optimizer)
    return bool(subs) and all(isinstance(sub, DistributedOptimizer) for sub in subs)


def master_pairs(sub: Any) -> list[MasterPair]:
    """The main parameters of one megatron optimizer with their model tensors, in optimizer order.

    Raises:
        ValueError: for an optimizer without separate fp32 state this module knows
            (precision-aware or fp8 distributed optimizers, Megatron-FSDP).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    if isinstance(sub, DistributedOptimizer):
        if sub.ddp_config.use_megatron_fsdp or sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise ValueError(
                "the optimizer keeps its fp32 state itself (Megatron-FSDP or the precision-aware "
                "optimizer); turn those off to reuse or swap the fp32 state"
            )
        pairs = []
        for main_group, model_group in zip(sub.shard_fp32_from_float16_groups, sub.model_float16_groups):
            for main, model_param in zip(main_group, model_group):
                world = sub._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = sub.model_param_gbuf_map[model_param]
                buffer = sub.buffers[gbuf_index].buckets[bucket_id].param_data
                pairs.append(MasterPair(main, buffer.view(-1)[world.start : world.end]))
        for main_group in sub.shard_fp32_groups:
            pairs += [MasterPair(main, None) for main in main_group]
        return pairs
    if isinstance(sub, Float16OptimizerWithFloat16Params):
        pairs = [
            MasterPair(main, model.data)
            for main_group, model_group in zip(sub.fp32_from_float16_groups, sub.float16_groups)
            for main, model in zip(main_group, model_group)
        ]
        return pairs + [MasterPair(main, None) for group in sub.fp32_from_fp32_groups for main in group]
    if isinstance(sub, FP32Optimizer):
        return [MasterPair(p, None) for group in sub.optimizer.param_groups for p in group["params"]]
    raise ValueError(
        f"unsupported megatron optimizer {type(sub).__name__}; use get_megatron_optimizer's "
        "Float16OptimizerWithFloat16Params, FP32Optimizer or DistributedOptimizer"
    )


def split_chunks(pairs: Sequence[MasterPair], times: int | None) -> list[list[MasterPair]]:
    """``pairs`` in about ``times`` chunks of similar element counts (``None``: one pair per chunk).

    A parameter is never split, so a chunk holds at least one whole parameter (shard).
    """
    if times is None or times >= len(pairs):
        return [[pair] for pair in pairs]
    total = sum(pair.numel for pair in pairs)
    target = -(-total // max(times, 1))
    chunks: list[list[MasterPair]] = [[]]
    filled = 0
    for pair in pairs:
        if chunks[-1] and filled + pair.numel > target:
            chunks.append([])
            filled = 0
        chunks[-1].append(pair)
        filled += pair.numel
    return chunks


class ChunkedStep:
    """Run one megatron optimizer's inner step chunk by chunk (see the module doc).

    Args:
        sub: a megatron optimizer (not a ``ChainedOptimizer``).
        chunks: the pairs of ``sub``, in chunks (:func:`split_chunks`).
        before: called with a chunk before its parameters step (bring the state in).
        after: called with a chunk after its parameters stepped and were copied to the model
            (send the state out).
    """

    def __init__(
        self,
        sub: Any,
        chunks: list[list[MasterPair]],
        before: Callable[[list[MasterPair]], None],
        after: Callable[[list[MasterPair]], None],
    ) -> None:
        self.sub, self.chunks, self.before, self.after = sub, chunks, before, after
        self.inner = sub.optimizer
        self.steps = 0  # chunked steps done (for tests and the report)
        self._inner_step = self.inner.step
        self.inner.step = self._step
        sub._copy_main_params_to_model_params = self._copy_main_to_model  # done per chunk in _step

    def _step(self, closure: Any = None) -> None:
        groups = self.inner.param_groups
        saved = [group["params"] for group in groups]
        try:
            for chunk in self.chunks:
                members = {id(pair.main) for pair in chunk}
                for group, params in zip(groups, saved):
                    group["params"] = [p for p in params if id(p) in members]
                self.before(chunk)
                self._inner_step()
                for pair in chunk:
                    if pair.model is not None:
                        # megatron's copy (a cast with round-to-nearest-even), moved into the loop.
                        pair.model.copy_(pair.main.view(pair.model.shape))
                self.after(chunk)
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        self.steps += 1

    def _copy_main_to_model(self) -> None:
        """megatron's main -> model copy after the inner step: already done chunk by chunk."""

    def remove(self) -> None:
        """Restore the inner step, megatron's copy and the checkpoint methods."""
        self.inner.step = self._inner_step
        for name in ("_copy_main_params_to_model_params", *STATE_METHODS):
            self.sub.__dict__.pop(name, None)


#: The megatron optimizer methods that read or write the whole state (checkpoints, reloads).
STATE_METHODS = ("state_dict", "sharded_state_dict", "load_state_dict", "reload_model_params")


def materialize_before_state_methods(sub: Any, materialize: Callable[[], None]) -> None:
    """Make ``sub``'s checkpoint methods bring the whole fp32 state back first.

    The state then stays resident (a checkpoint save reads it after the call returns) until the
    next ``step()``, whose chunks send it away again; a load writes into resident tensors.
    """
    for name in STATE_METHODS:
        original = getattr(sub, name, None)
        if original is None:
            continue

        def call(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            materialize()
            return _original(*args, **kwargs)

        setattr(sub, name, call)
