"""Co-location memory: move an actor's tensors to host memory and back (verl / MindSpeed-RL style).

When the rollout engine generates on the same device as the actor, the actor's optimizer state,
gradient buffers and (for a frozen reference) weights only take room. :class:`StorageOffloader`
copies each tensor *storage* to a host buffer (pinned where the accelerator supports it) and
frees the device storage with ``untyped_storage().resize_(0)``; onloading resizes it back and
copies the bytes in. Working on storages rather than tensors keeps every view valid (megatron's
``param.main_grad`` and bucket views into ``grad_data``, parameters that are views of a
distributed optimizer's ``param_data``), frees the memory on every device the same way (on the
CPU too, where it is observable in tests), and restores the bytes exactly.

Storages are grouped in named categories (``optimizer``, ``grad``, ``weights``); a storage
belongs to the first category that registered it, so a tensor shared by two is moved once.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger

logger = get_logger(__name__)


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None  # uint8 [nbytes] while offloaded


@dataclass
class _Category:
    entries: list[_Entry] = field(default_factory=list)
    offloaded: bool = False


def read_host_rss() -> int:
    """Resident set size of this process in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_snapshot() -> dict[str, int]:
    """Bytes in use now: ``device_allocated`` and ``device_peak`` (the accelerator's counters; on
    the CPU the process' resident set and its peak) and ``host_rss``."""
    stats = get_accelerator().memory_stats()
    return {
        "device_allocated": int(stats.get("allocated", 0)),
        "device_peak": int(stats.get("peak_allocated", 0)),
        "host_rss": read_host_rss(),
    }


def memory_gib() -> dict[str, float]:
    """:func:`memory_snapshot` in GiB, keys suffixed ``_gib`` (the workers' phase metrics)."""
    return {f"{k}_gib": v / 2**30 for k, v in memory_snapshot().items()}


class StorageOffloader:
    """Named groups of device storages that can be moved to host memory and back.

    Args:
        device: the device whose storages are managed (tensors elsewhere are skipped: e.g.
            torch's Adam keeps its ``step`` counter on the host).
        pin: copy into pinned host buffers (faster transfers; needs accelerator support).
    """

    def __init__(self, device: torch.device, pin: bool = False) -> None:
        self.device, self.pin = torch.device(device), pin
        self._categories: dict[str, _Category] = {}
        self._owner: dict[int, str] = {}

    def register(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        """Add the storages of ``tensors`` to ``category`` (skipping None, other devices, empty
        storages and storages already registered).

        Raises:
            RuntimeError: registering into a category that is offloaded now.
        """
        group = self._categories.setdefault(category, _Category())
        if group.offloaded:
            raise RuntimeError(f"cannot register tensors into the offloaded category {category!r}")
        for tensor in tensors:
            if tensor is None or tensor.device.type != self.device.type:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata  # the storage object itself: stable across resize_
            if key in self._owner or storage.nbytes() == 0:
                continue
            self._owner[key] = category
            group.entries.append(_Entry(storage, storage.nbytes()))

    def clear(self, category: str) -> None:
        """Forget ``category``'s storages (onload it first; e.g. to re-register after a rebuild)."""
        group = self._categories.pop(category, None)
        if group is None:
            return
        if group.offloaded:
            raise RuntimeError(f"onload {category!r} before clearing it")
        for entry in group.entries:
            self._owner.pop(entry.storage._cdata, None)

    def offload(self, category: str) -> int:
        """Copy ``category``'s storages to host memory and free them on the device (idempotent).

        Returns:
            The bytes moved by this call (0 when it was offloaded already or is unknown).
        """
        group = self._categories.get(category)
        if group is None or group.offloaded:
            return 0
        moved = 0
        for entry in group.entries:
            host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=self.pin)
            host.copy_(self._bytes(entry))
            entry.host = host
            entry.storage.resize_(0)
            moved += entry.nbytes
        group.offloaded = True
        return moved

    def onload(self, category: str) -> int:
        """Restore ``category``'s storages on the device with their bytes (idempotent).

        Returns:
            The bytes moved by this call.
        """
        group = self._categories.get(category)
        if group is None or not group.offloaded:
            return 0
        moved = 0
        for entry in group.entries:
            entry.storage.resize_(entry.nbytes)
            self._bytes(entry).copy_(entry.host)
            entry.host = None
            moved += entry.nbytes
        group.offloaded = False
        return moved

    def is_offloaded(self, category: str) -> bool:
        """Whether ``category`` lives on the host now."""
        group = self._categories.get(category)
        return bool(group and group.offloaded)

    def offloaded_bytes(self) -> dict[str, int]:
        """Per category, the bytes held on the host now (0 for categories on the device)."""
        return {name: (sum(e.nbytes for e in g.entries) if g.offloaded else 0) for name, g in self._categories.items()}

    def _bytes(self, entry: _Entry) -> torch.Tensor:
        # A flat byte tensor over the whole storage: copies cover every view into it.
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(entry.storage, 0, (entry.nbytes,))


def collect_offload_tensors(chunks: list[Any], optimizer: Any, category: str) -> list[torch.Tensor]:
    """The tensors of one offload category of a megatron model and optimizer.

    Args:
        chunks: the model chunks (DDP-wrapped or bare).
        optimizer: megatron's optimizer (None for a frozen model).
        category: ``weights`` (the parameters), ``grad`` (DDP ``grad_data`` buffers,
            ``param.main_grad`` and ``param.grad``) or ``optimizer`` (fp32 master copies and
            their gradients, and the per-parameter state: Adam's ``exp_avg`` / ``exp_avg_sq``).

    Returns:
        The tensors (possibly sharing storages, possibly None; :meth:`StorageOffloader.register`
        deduplicates).
    """
    params = [p for chunk in chunks for p in chunk.parameters()]
    if category == "weights":
        return params
    if category == "grad":
        # megatron's DDP keeps its ParamAndGradBuffers in list attributes (a bare module's
        # ``buffers`` is nn.Module's method: a frozen model has no gradient buffers).
        buffers = [
            b
            for chunk in chunks
            for attr in ("buffers", "expert_parallel_buffers")
            for b in (vars(chunk).get(attr) or [])
        ]
        return (
            [b.grad_data for b in buffers] + [getattr(p, "main_grad", None) for p in params] + [p.grad for p in params]
        )
    if category != "optimizer":
        raise ValueError(f"unknown offload category {category!r}; use weights, grad or optimizer")
    if optimizer is None:
        return []
    tensors: list[torch.Tensor] = []
    for megatron_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                tensors += [param, param.grad]
                tensors += [v for v in inner.state.get(param, {}).values() if torch.is_tensor(v)]
    return tensors


def freeze_startup_objects() -> None:
    """Exempt every object alive now from Python's cyclic garbage collector (``gc.freeze``).

    Once actor, engine and tokenizer are built, the process holds a large heap of long-lived
    objects (megatron, transformers and torch modules); every full collection walks all of it:
    0.3 s of CPU on the GRPO benchmark's process, once every few steps. Frozen objects are never
    collected (until ``gc.unfreeze()``), which is what long-lived ones need anyway. Called by
    :func:`~mindspeed_rl.driver.trainer.train_grpo` (which unfreezes at its end) and by the Ray workers
    once built.
    """
    gc.collect()
    gc.freeze()
