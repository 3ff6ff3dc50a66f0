"""One attention mask per step, shared by every layer (MindSpeed's ``generate-mask`` idea).

Every layer of a model attends with the same mask: the same sequence lengths, the same causal
flag and window, and (for packed sequences) the very same ``cu_seqlens`` tensor, which megatron
hands to every layer in one ``PackedSeqParams``. The attention kernels build their masks, ALiBi
biases and packed-sequence plans through :func:`shared_mask`, so the first layer builds them and
the others (and the backward) reuse them: one construction per step instead of one per layer.

Packed sequences are keyed by the identity and version counter of their ``cu_seqlens`` tensor,
ALiBi biases by those of the slopes (the entry holds a reference, so the id cannot be reused
while it is cached, and an in-place change bumps the version): reading its values would cost a host sync per layer, which is one of
the things being saved. Each key (kind, lengths, flags, device) holds one mask, replaced when
its tensors change (the next microbatch), and the cache the last :data:`CACHE_SIZE` keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: Masks kept: a step uses one or two (sliding-window and full layers, or the forward's and a
#: recomputation's shapes); a few more cover evaluation alternating with training.
CACHE_SIZE = 4

_entries: OrderedDict[Hashable, tuple[tuple[torch.Tensor | None, ...], tuple[int, ...], Any]] = OrderedDict()
#: How many masks were built (a construction, not a reuse), for tests and the docs' numbers.
stats = {"built": 0, "reused": 0}


def _versions(tensors: tuple[torch.Tensor | None, ...]) -> tuple[int, ...]:
    return tuple(-1 if t is None else t._version for t in tensors)


def shared_mask(
    key: Hashable, tensors: torch.Tensor | None | tuple[torch.Tensor | None, ...], build: Callable[[], T]
) -> T:
    """``build()``'s result for ``key`` and these very tensors, built once and then reused.

    Args:
        key: everything the result depends on besides ``tensors`` (kind, lengths, flags,
            device, dtype); hashable.
        tensors: the tensors the result is built from (``cu_seqlens``, ALiBi slopes; ``None``
            for absent ones), matched by identity and version counter, never by value.
        build: makes the result; its result must not be modified by the caller.
    """
    tensors = tensors if isinstance(tensors, tuple) else (tensors,)
    entry = _entries.get(key)
    if entry is not None and all(a is b for a, b in zip(entry[0], tensors)) and entry[1] == _versions(tensors):
        _entries.move_to_end(key)
        stats["reused"] += 1
        return entry[2]
    value = build()
    stats["built"] += 1
    # One slot per key: the next microbatch's cu_seqlens replaces the last one's mask, so no
    # more masks stay alive than the one a layer held while it attended.
    _entries[key] = (tensors, _versions(tensors), value)
    _entries.move_to_end(key)
    while len(_entries) > CACHE_SIZE:
        _entries.popitem(last=False)
    return value


def clear_masks() -> None:
    """Drop every cached mask (and reset :data:`stats`)."""
    _entries.clear()
    stats.update(built=0, reused=0)
