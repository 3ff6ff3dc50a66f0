"""Peak memory of a block of code, measured the same way on every accelerator.

On a device with a caching allocator (cuda, npu) the allocator already counts every byte:
:func:`measure_peak_memory` resets its peak counter at entry and reads it at exit through the
accelerator seam. The CPU has no such counter (the resident set size moves in pages, and
glibc keeps freed blocks), so there a :class:`StorageTracker` watches the ATen dispatcher
instead: it adds the bytes of every new storage an op returns and subtracts them when the
storage is freed, which gives the live tensor bytes at every op and so their peak.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mindspeed.device import get_accelerator

#: Methods :func:`measure_peak_memory` accepts.
METHODS = ("auto", "allocator", "dispatch")

_MIB = float(1 << 20)

#: Ops whose tensor argument was just built outside the dispatcher (by ``torch.tensor``).
_FRESH_OPS = frozenset({torch.ops.aten.lift_fresh.default})

#: Host buffers tagged by :func:`mark_host` (``StorageImpl`` address -> its finalizer): on the
#: CPU the :class:`StorageTracker` stands in for a device allocator and never counts them, so
#: what it measures is the "device pool" (tensors that would live on an accelerator).
_HOST_STORAGES: dict[int, weakref.finalize] = {}
#: Trackers inside their block, told when a storage they counted turns out to be a host buffer.
_TRACKERS: weakref.WeakSet = weakref.WeakSet()


@dataclass
class PeakMemory:
    """What :func:`measure_peak_memory` measured; filled in when the block exits.

    Attributes:
        method: ``"allocator"`` (the device's caching allocator) or ``"dispatch"`` (tensor
            storages seen by the ATen dispatcher).
        peak_bytes: the highest tensor memory in use during the block, above what was in use
            at entry.
        end_bytes: the tensor memory still in use at exit, above what was in use at entry.
    """

    method: str
    peak_bytes: int = 0
    end_bytes: int = 0

    @property
    def peak_mib(self) -> float:
        """``peak_bytes`` in MiB."""
        return self.peak_bytes / _MIB


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``tensor``, or ``None`` where it has no real memory of its own."""
    if tensor.device.type == "meta" or tensor.is_sparse:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # nested, functional or other storage-less tensors
        return None


class StorageTracker(TorchDispatchMode):
    """Dispatch mode that counts the live bytes of tensor storages and remembers their peak.

    Storages are keyed by their ``StorageImpl`` address (``UntypedStorage._cdata``), which
    is shared by every view and stays the same when a storage is resized, unlike
    ``data_ptr``. A storage is freed when its last tensor (or autograd's saved copy) goes
    away; torch keeps the Python storage object alive exactly as long as the C++ one, so a
    ``weakref.finalize`` on it fires at that moment. Storages that existed before entry are
    not counted, but the ones an op reads are watched too, so freeing them inside the block
    lowers the live total just as it would on a device allocator.

    Only memory that ops hand back is seen: scratch buffers a kernel allocates and frees
    internally are not, so the result is a lower bound of what an allocator would report.

    Args:
        from_empty: the block starts from an empty device pool (a tracker entered before the
            model is built): storages it did not see allocated are not counted at all, also
            not when they are freed. Without it their free lowers the live total, as it must
            for memory that was in use at entry; but buffers made outside the dispatcher
            inside the block (gloo's reduce-scatter copies its whole input in C++) would then
            drive the total below the truth at every step.
    """

    def __init__(self, from_empty: bool = False) -> None:
        super().__init__()
        self.from_empty = from_empty
        self._foreign: set[int] = set()  # from_empty: storages seen but not seen allocated
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # StorageImpl address -> bytes counted for it
        self._before: dict[int, int] = {}  # storages from before entry -> their size then
        self._finalizers: dict[int, weakref.finalize] = {}  # same keys, until the storage is freed
        self._lock = threading.RLock()  # a free can run re-entrantly while an op is counted
        self._active = False

    def __enter__(self) -> StorageTracker:
        self._active = True
        _TRACKERS.add(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _TRACKERS.discard(self)
            with self._lock:
                self._active = False
                # Storages that outlive the block must not call back into a finished tracker.
                for fin in self._finalizers.values():
                    fin.detach()
                self._finalizers.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FRESH_OPS:
            # torch.tensor(...) builds its data outside the dispatcher and then "lifts" it:
            # the argument is a new allocation, not an old tensor.
            out = func(*args, **kwargs)
            with self._lock:
                for key, storage in self._storages(tree_leaves(out)).items():
                    if key not in self._sizes:
                        self._add(key, storage, storage.nbytes())
            return out
        inputs = self._storages(tree_leaves((args, kwargs)))
        input_sizes = {key: storage.nbytes() for key, storage in inputs.items()}
        with self._lock:
            # A storage resized outside the dispatcher (``untyped_storage().resize_``, which
            # output-discarding recompute and swapping use) counts its new size from the next
            # op that reads it, at the latest.
            for key, nbytes in input_sizes.items():
                if key in self._sizes and self._sizes[key] != nbytes - self._before.get(key, 0):
                    self._resize(key, nbytes - self._before.get(key, 0))
        out = func(*args, **kwargs)
        with self._lock:
            for key, storage in inputs.items():
                self._watch_existing(key, storage, input_sizes[key])
            for key, storage in self._storages(tree_leaves(out)).items():
                if key in self._sizes:
                    # In place (a view, add_, resize_): only a change of size counts; an old
                    # storage counts its growth beyond the size it had at entry.
                    self._resize(key, storage.nbytes() - self._before.get(key, 0))
                elif key in self._foreign and key in inputs:
                    continue  # in place on a storage not seen allocated (from_empty)
                else:
                    self._foreign.discard(key)  # an address freed outside the dispatcher, reused
                    self._add(key, storage, storage.nbytes())
        return out

    @staticmethod
    def _storages(leaves: list[Any]) -> dict[int, torch.UntypedStorage]:
        found: dict[int, torch.UntypedStorage] = {}
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                storage = _storage_of(leaf)
                if storage is not None and storage._cdata not in _HOST_STORAGES:
                    found.setdefault(storage._cdata, storage)
        return found

    def _resized(self, storage: torch.UntypedStorage, old: int, new: int) -> None:
        # resize_storage() told us: count the new size now.
        with self._lock:
            key = storage._cdata
            if key in _HOST_STORAGES:
                return
            if key not in self._sizes:
                if self.from_empty:
                    return
                self._watch_existing(key, storage, old)
            self._resize(key, new - self._before.get(key, 0))

    def _forget(self, key: int) -> None:
        # A storage counted so far is a host buffer (mark_host): it leaves the device pool.
        with self._lock:
            if key in self._sizes:
                self.live_bytes -= self._sizes.pop(key)
                self._before.pop(key, None)
                self._finalizers.pop(key).detach()

    def _add(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        self._sizes[key] = nbytes
        self._finalizers[key] = weakref.finalize(storage, self._free, key)
        self._bump(nbytes)

    def _watch_existing(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        # A storage from before entry, seen for the first time: nothing to add now, but its
        # free gives memory back (counted negative, as the entry baseline included it).
        if self.from_empty:
            if key not in self._sizes:
                self._foreign.add(key)
            return
        if key not in self._sizes:
            self._sizes[key], self._before[key] = 0, nbytes
            self._finalizers[key] = weakref.finalize(storage, self._free, key)

    def _resize(self, key: int, nbytes: int) -> None:
        delta = nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self._bump(delta)

    def _bump(self, delta: int) -> None:
        self.live_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        with self._lock:
            if self._active:
                self.live_bytes -= self._before.pop(key, 0) + self._sizes.pop(key, 0)
                self._finalizers.pop(key, None)


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Tag ``tensor``'s storage as host memory: the dispatch tracker no longer counts it.

    On an accelerator the device allocator never sees host buffers; on the CPU the
    :class:`StorageTracker` is the allocator's stand-in, and this keeps host copies (swap
    buffers) out of its "device pool". Create the buffer inside :func:`untracked` so its
    allocation is not counted either.

    Returns:
        ``tensor``.
    """
    storage = _storage_of(tensor)
    if storage is None:
        return tensor
    key = storage._cdata
    if key not in _HOST_STORAGES:
        _HOST_STORAGES[key] = weakref.finalize(storage, _HOST_STORAGES.pop, key, None)
    for tracker in list(_TRACKERS):
        tracker._forget(key)
    return tensor


def resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    r"""Resize ``tensor``'s storage to ``nbytes`` (0 frees it, the tensor keeps its shape), counted at once.

    ``untyped_storage().resize_`` bypasses the dispatcher; active :class:`StorageTracker`\ s
    are told directly, so a peak measured on the CPU sees the bytes go and come back.
    """
    storage = tensor.untyped_storage()
    old = storage.nbytes()
    storage.resize_(nbytes)
    for tracker in list(_TRACKERS):
        tracker._resized(storage, old, nbytes)


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Run a block outside any :class:`StorageTracker` (allocate host buffers here, then :func:`mark_host`)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def resolve_method(method: str = "auto") -> str:
    """The measurement :func:`measure_peak_memory` uses for ``method`` on this accelerator.

    Args:
        method: ``"auto"``, ``"allocator"`` or ``"dispatch"``.

    Returns:
        ``"allocator"`` or ``"dispatch"``.

    Raises:
        ValueError: if ``method`` is unknown.
    """
    if method not in METHODS:
        raise ValueError(f"unknown peak-memory method {method!r}; use one of: {', '.join(METHODS)}")
    if method != "auto":
        return method
    # A device family with a torch module (torch.cuda, torch.npu) has a caching allocator.
    return "dispatch" if get_accelerator().torch_module is None else "allocator"


@contextlib.contextmanager
def measure_peak_memory(method: str = "auto") -> Iterator[PeakMemory]:
    """Measure the peak tensor memory that a block of code adds on the current accelerator.

    Usage::

        with measure_peak_memory() as mem:
            loss = model(x).sum()
            loss.backward()
        peak = mem.peak_bytes  # bytes above the level at entry

    Args:
        method: ``"auto"`` (the allocator's counters where the accelerator has a caching
            allocator, else dispatch tracking), ``"allocator"`` or ``"dispatch"``. On an
            allocator the measurement resets the device's peak counter, so it must not be
            nested in another allocator measurement.

    Returns:
        A context manager yielding a :class:`PeakMemory` whose fields are set at exit.

    Raises:
        ValueError: if ``method`` is unknown.
    """
    chosen = resolve_method(method)
    result = PeakMemory(method=chosen)
    if chosen == "dispatch":
        tracker = StorageTracker()
        try:
            with tracker:
                yield result
        finally:
            result.peak_bytes, result.end_bytes = tracker.peak_bytes, tracker.live_bytes
        return
    accelerator = get_accelerator()
    accelerator.synchronize()
    baseline = accelerator.memory_stats()["allocated"]
    accelerator.reset_peak_memory_stats()
    try:
        yield result
    finally:
        accelerator.synchronize()
        stats = accelerator.memory_stats()
        result.peak_bytes = max(0, stats["peak_allocated"] - baseline)
        result.end_bytes = stats["allocated"] - baseline
