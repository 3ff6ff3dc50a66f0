"""Recompute in advance (MindSpeed's ``--recompute-in-advance``): block recompute started by the schedule.

megatron's full recompute with ``recompute_method: block`` checkpoints the first
``recompute_num_layers`` layers of every model chunk; its reentrant ``CheckpointFunction``
recomputes a layer as the first step of that layer's backward, so with pipelining the recompute
waits for the next stage's gradient. ``--recompute-in-advance`` replaces it with the units of
:mod:`mindspeed.memory.ripipe` at layer granularity: megatron's recompute is switched off (the
feature sets ``recompute_granularity`` to ``None``), the same layers run under a pack hook that
keeps an index instead of each saved tensor and records the layer's call (its arguments, which a
checkpoint keeps too, and the RNG states), and the schedule regenerates a chunk-forward's layers
before it waits for the gradient of that chunk's backward (:class:`AdvanceRecompute`, the same
seams as ``--recompute-in-bubble``). The model's last layer is not recomputed at all (its
backward follows its forward directly). The values are those of the forward, so training is
bit-identical to megatron's block recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mindspeed.log import get_logger
from mindspeed.memory.recompute import transformer_layers
from mindspeed.memory.ripipe import BubbleRecompute, PassStats, rng_states, saved_nbytes, set_rng_states

__all__ = ["AdvanceRecompute", "LayerUnit", "RecomputeInAdvance"]

logger = get_logger(__name__)


def _unwrapped(chunk: nn.Module) -> nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class _LayerCall:
    """One layer call of a chunk-forward: what replays it and, once regenerated, its saved tensors."""

    def __init__(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        self.layer, self.args, self.kwargs, self.rng = layer, args, kwargs, rng_states()
        self.count = 0
        self.tensors: list[torch.Tensor | None] | None = None


class LayerUnit:
    """The recomputed layers of one chunk-forward (the first ``recompute_num_layers`` of the chunk)."""

    def __init__(self, stats: PassStats) -> None:
        self.stats = stats
        self.calls: list[_LayerCall] = []
        self._hooks: contextlib.ExitStack | None = None

    @property
    def ready(self) -> bool:
        """Whether every layer's saved tensors have been regenerated."""
        return all(call.tensors is not None for call in self.calls)

    def begin(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        """A recomputed layer starts: its saved tensors become indices."""
        call = _LayerCall(layer, args, kwargs)
        index = len(self.calls)
        self.calls.append(call)

        def pack(t: torch.Tensor) -> tuple[int, int]:
            call.count += 1
            return index, call.count - 1

        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, self._unpack))

    def end(self) -> None:
        """The layer returned."""
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None

    def recompute(self) -> None:
        """Regenerate every layer's saved tensors (under :attr:`replaying`, which mutes the layer hooks)."""
        caller_rng = rng_states()
        try:
            for call in self.calls:
                if call.tensors is not None:
                    continue
                tensors: list[torch.Tensor] = []
                set_rng_states(call.rng)
                with (
                    self.replaying(),
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(lambda t, out=tensors: out.append(t.detach()), _never),
                ):
                    call.layer(*call.args, **call.kwargs)
                if len(tensors) != call.count:
                    raise RuntimeError(
                        f"a layer's recompute saved {len(tensors)} tensors, its forward {call.count}; "
                        "turn recompute_in_advance off"
                    )
                call.tensors = tensors
                self.stats.saved.add(sum(saved_nbytes(t) for t in tensors))
        finally:
            set_rng_states(caller_rng)

    def _unpack(self, packed: tuple[int, int]) -> torch.Tensor:
        index, position = packed
        call = self.calls[index]
        if call.tensors is None:  # nothing regenerated it before the backward
            self.stats.inline += 1
            self.recompute()
        tensor = call.tensors[position]
        if tensor is None:
            raise RuntimeError("a saved tensor of a recompute-in-advance layer was read twice (retain_graph)")
        call.tensors[position] = None
        self.stats.saved.add(-saved_nbytes(tensor))
        return tensor

    #: A context that mutes the layer hooks while the layers replay (set by the scheduler).
    replaying: Callable[[], Any] = contextlib.nullcontext


def _never(_: Any) -> None:
    raise RuntimeError("a recompute's own graph is never run backward")


class RecomputeInAdvance:
    """The two hooks of ``--recompute-in-advance``: layer hooks on the chunks, a scheduler per pass.

    Args:
        num_layers: megatron's ``recompute_num_layers`` (block method): the first layers of each chunk.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layers: list[nn.Module] = []
        self.current: LayerUnit | None = None
        self._replaying = False
        self.passes: list[PassStats] = []

    def install(self, chunks: list[nn.Module]) -> None:
        """``post_model_build``: hooks on the first ``num_layers`` layers of each chunk, less the model's last."""
        chunks = list(chunks)
        last = None
        if getattr(_unwrapped(chunks[-1]), "post_process", False):
            last = transformer_layers(chunks[-1:])[-1][2]
        for _, index, layer in transformer_layers(chunks):
            if index < self.num_layers and layer is not last:
                layer.register_forward_pre_hook(self._pre, with_kwargs=True)
                layer.register_forward_hook(self._post)
                self.layers.append(layer)

    @contextlib.contextmanager
    def replaying(self) -> Any:
        """Mute the layer hooks while a unit replays its layers."""
        self._replaying, before = True, self._replaying
        try:
            yield
        finally:
            self._replaying = before

    def _pre(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.current is not None and not self._replaying and torch.is_grad_enabled():
            self.current.begin(layer, args, kwargs)

    def _post(self, layer: nn.Module, args: tuple, output: Any) -> None:
        if self.current is not None and not self._replaying:
            self.current.end()

    def for_pass(self, chunks: list[nn.Module], num_microbatches: int) -> AdvanceRecompute | None:
        """``pipeline_schedule``: the wrapper of one pass (``None`` without virtual stages)."""
        if len(chunks) < 2:
            return None
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        group_size = config.microbatch_group_size_per_vp_stage or config.pipeline_model_parallel_size
        wrapper = AdvanceRecompute(self, chunks, num_microbatches, group_size, log=not self.passes)
        self.passes.append(wrapper.stats)
        return wrapper


class AdvanceRecompute(BubbleRecompute):
    """The scheduler side of ``--recompute-in-advance``: every chunk-forward's recomputed layers form a unit."""

    def __init__(
        self,
        owner: RecomputeInAdvance,
        chunks: list[nn.Module],
        num_microbatches: int,
        group_size: int,
        log: bool = False,
    ) -> None:
        super().__init__(chunks, num_microbatches, group_size, kept_chunks=0, log=log)
        self.owner = owner

    def _log(self) -> None:
        s = self.stats
        logger.info(
            "recompute_in_advance: %d of %d chunk-forwards recompute layers (%d hooked on this rank); regenerated %d "
            "before a gradient receive, %d at their backward; peak regenerated activations %.1f MiB",
            s.dropped,
            len(self.order),
            len(self.owner.layers),
            s.scheduled,
            s.at_backward,
            s.saved.peak / 2**20,
        )

    def _forward(
        self, forward_step_func: Callable[..., Any], key: tuple[int, int], data_iterator: Any, model: nn.Module, *args
    ) -> Any:
        unit = LayerUnit(self.stats)
        unit.replaying = self.owner.replaying
        self.owner.current = unit
        try:
            result = forward_step_func(data_iterator, model, *args)
        finally:
            self.owner.current = None
        self._units[key] = unit if unit.calls else None
        self.stats.dropped += bool(unit.calls)
        return result
