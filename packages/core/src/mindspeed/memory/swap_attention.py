"""``--swap-attention``: saved activations of chosen modules go to host memory in the forward.

Autograd keeps the tensors a module's backward needs from the forward to the backward. Inside
the chosen submodules of every megatron ``TransformerLayer`` (``--swap-modules``; MindSpeed's
default ``input_norm,self_attention,post_attention_norm``, megatron's names
``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm``), a
``torch.autograd.graph.saved_tensors_hooks`` pair replaces each saved tensor of at least
``min_bytes`` by a host copy: the device-to-host copy runs on the accelerator's side stream,
and the device memory goes back to the pool as soon as nothing else holds the tensor (the
forward's own references end; autograd no longer holds one). In the backward, when layer
``k``'s output gradient arrives, the saved tensors of layer ``k - 1`` are prefetched
host-to-device on the side stream, so they are back before that layer's backward needs them;
a tensor not prefetched is copied back when unpacked. The values are copied, not recomputed:
training is bit-identical to the run without it.

Parameters (leaf tensors that require a gradient) are never swapped. On the CPU copies are
synchronous, and host buffers are tagged so the dispatch-level tracker counts only the device
pool (:func:`mindspeed.metrics.memory.mark_host`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.memory.recompute import transformer_layers
from mindspeed.metrics.memory import mark_host, untracked

logger = get_logger(__name__)

#: MindSpeed's ``--swap-modules`` names -> megatron ``TransformerLayer`` attributes.
MODULE_NAMES = {
    "input_norm": "input_layernorm",
    "self_attention": "self_attention",
    "post_attention_norm": "pre_mlp_layernorm",
}
#: MindSpeed's default ``--swap-modules``.
DEFAULT_MODULES = ("input_norm", "self_attention", "post_attention_norm")


class _HostPool:
    """Host buffers kept for reuse: a pinned allocation is expensive on an accelerator, and a fresh
    one is page-faulted in on first touch everywhere; the next forward reuses the last one's.

    A buffer is given back when its tensor is back on the device: a later device -> host copy
    into it is queued on the same side stream as the host -> device copy that read it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((shape.numel(), dtype))
        if free:
            return free.pop().view(shape)
        with untracked():
            flat = get_accelerator().empty_host((shape.numel(),), dtype=dtype)
        mark_host(flat)
        return flat.view(shape)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer.view(-1))

    def clear(self) -> None:
        self._free = {}


class _Swapped:
    """One saved tensor on its way to the host and back."""

    __slots__ = ("host", "device", "event", "source", "prefetched", "pool", "uses")

    def __init__(self, tensor: torch.Tensor, side: Any, pool: _HostPool) -> None:
        acc = get_accelerator()
        self.device = tensor.device
        self.pool, self.uses = pool, 1  # uses: saves of this view not unpacked yet
        self.host: torch.Tensor | None = pool.take(tensor.shape, tensor.dtype)
        side.wait_stream(acc.current_stream())
        with acc.use_stream(side):
            self.host.copy_(tensor, non_blocking=True)
            self.event = side.record_event()
        self.source: torch.Tensor | None = tensor  # kept until the copy has left the device
        self.prefetched: torch.Tensor | None = None

    def settle(self) -> None:
        """Wait for the device-to-host copy, then drop the device reference."""
        if self.source is not None:
            self.event.synchronize()
            self.source = None

    def prefetch(self, side: Any) -> None:
        """Start the host-to-device copy on ``side``."""
        if self.prefetched is not None:
            return
        if self.host is None:
            raise RuntimeError(
                "swap: a saved tensor was unpacked twice (a backward with retain_graph=True); "
                "turn the activation swap off for this model"
            )
        self.settle()
        acc = get_accelerator()
        self.prefetched = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        side.wait_stream(acc.current_stream())
        with acc.use_stream(side):
            self.prefetched.copy_(self.host, non_blocking=True)
            self.event = side.record_event()

    def unpack(self, side: Any) -> torch.Tensor:
        """The tensor on the device again (waits for the prefetch, or copies now)."""
        if self.source is not None and self.prefetched is None:
            tensor, self.source = self.source, None  # the copy may still run: use the original
        else:
            self.prefetch(side)
            get_accelerator().current_stream().wait_event(self.event)
            tensor, self.prefetched = self.prefetched, None
        self.uses -= 1
        if self.uses == 0:  # the last save of this view is back: its buffer can serve another
            self.pool.give(self.host)
            self.host = None
        return tensor


@dataclass
class _LayerSwap:
    """The swapped tensors of one layer's chosen modules in one forward."""

    handles: list[_Swapped] = field(default_factory=list)
    by_view: dict[tuple, _Swapped] = field(default_factory=dict)  # the same view saved twice: one copy


@dataclass
class SwapAttention:
    """A ``post_model_build`` hook: swap the saved activations of the chosen layer submodules to the host.

    Attributes:
        modules: MindSpeed's ``--swap-modules`` names (:data:`MODULE_NAMES`).
        min_bytes: smaller saved tensors stay on the device (their copies cost more than they free).
        swapped_bytes: device bytes sent to the host so far (for tests and the report).
    """

    modules: tuple[str, ...] = DEFAULT_MODULES
    min_bytes: int = 1 << 14
    swapped_bytes: int = 0
    _hooks: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = [m for m in self.modules if m not in MODULE_NAMES]
        if unknown:
            raise ValueError(f"swap_attention: unknown swap_modules {unknown}; use some of {sorted(MODULE_NAMES)}")

    def install(self, chunks: Iterable[nn.Module]) -> SwapAttention:
        """Hook every ``TransformerLayer`` of ``chunks`` (the trainer calls it once the model is built)."""
        self._side, self._pool = get_accelerator().stream(), _HostPool()
        found = transformer_layers(chunks)
        layers = [layer for _, _, layer in found]
        self._first = {id(layer) for _, index, layer in found if index == 0}
        # The layer being run and the one before it in this forward; the tensors themselves are
        # owned by autograd's graph (and the prefetch hooks on it), so they go with it.
        self._current: _LayerSwap | None = None
        self._previous: _LayerSwap | None = None
        for layer in layers:
            for name in self.modules:
                module = getattr(layer, MODULE_NAMES[name])
                self._hooks.append(module.register_forward_pre_hook(self._enter))
                self._hooks.append(module.register_forward_hook(self._exit))
            self._hooks.append(layer.register_forward_pre_hook(self._start_layer))
            self._hooks.append(layer.register_forward_hook(self._end_layer))
        logger.info("swap_attention: %s of %d layers", ", ".join(self.modules), len(layers))
        return self

    def install_modules(self, modules: Iterable[nn.Module]) -> SwapAttention:
        """Hook arbitrary modules, each its own "layer" (a trainer's module-name patterns; ``modules``
        ignored). Give them in forward order: the first starts a new forward, and each one's saved
        tensors are prefetched when the output gradient of the next one arrives.
        """
        self._side, self._pool = get_accelerator().stream(), _HostPool()
        modules = list(modules)
        self._first = {id(modules[0])} if modules else set()
        self._current, self._previous = None, None
        for module in modules:
            self._hooks.append(module.register_forward_pre_hook(self._start_layer))
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._exit))
            self._hooks.append(module.register_forward_hook(self._end_layer))
        logger.info("swap: saved activations of %d modules to the host", len(modules))
        return self

    def remove(self) -> None:
        """Remove every hook (the model runs as before)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._pool.clear()

    # -- forward ---------------------------------------------------------------------------
    def _start_layer(self, layer: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and layer.training:
            if id(layer) in self._first:  # a new forward of this chunk: nothing before it to prefetch
                self._previous = None
            self._current = _LayerSwap()

    def _end_layer(self, layer: nn.Module, args: Any, output: Any) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        for handle in current.handles:
            handle.settle()  # the layer's copies have left: the device memory can go
        hidden = output[0] if isinstance(output, tuple) else output
        previous, self._previous = self._previous, current
        if previous is not None and previous.handles and torch.is_tensor(hidden) and hidden.requires_grad:
            # This layer's output gradient arrives just before its backward: bring the layer
            # before it back meanwhile.
            hidden.register_hook(lambda grad: self._prefetch(previous))

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not (torch.is_grad_enabled() and module.training and self._current is not None):
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        module._mindspeed_swap_hooks = hooks

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = module.__dict__.pop("_mindspeed_swap_hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or (tensor.is_leaf and tensor.requires_grad) or isinstance(tensor, nn.Parameter):
            return tensor
        view = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        handle = self._current.by_view.get(view)
        if handle is None:  # (the first copy keeps its source alive to the layer's end: no address reuse)
            handle = self._current.by_view[view] = _Swapped(tensor, self._side, self._pool)
            self._current.handles.append(handle)
            self.swapped_bytes += nbytes
        else:
            handle.uses += 1
        return handle

    # -- backward --------------------------------------------------------------------------
    def _prefetch(self, layer: _LayerSwap) -> None:
        for handle in layer.handles:
            handle.prefetch(self._side)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return packed.unpack(self._side) if isinstance(packed, _Swapped) else packed
