"""Co-location memory of the GRPO actor: offload and onload of its tensors, per-phase memory.

:class:`ActorMemory` is a part of :class:`~mindspeed_rl.models.actor.Actor`: the optimizer state, the
DDP gradient buffers and the weights can move to host memory while a rollout engine uses the
device (:mod:`mindspeed_rl.models.memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_rl.models.memory import collect_offload_tensors, memory_snapshot

logger = get_logger("mindspeed_rl.models.actor")

#: Categories :meth:`ActorMemory.offload` moves, in the order their storages are claimed.
OFFLOAD_CATEGORIES = ("grad", "weights", "optimizer")


class ActorMemory:
    """Offload / onload of the actor's categories (reads its chunks, optimizer and ``_offloader``)."""

    chunks: list[Any]
    optimizer: Any
    _offloader: Any

    def _refresh_categories(self) -> None:
        # Optimizer state appears at the first step and master gradients change every step:
        # re-collect what is on the device now, in a fixed order so a shared storage (a
        # master param that is the model's own parameter) always lands in the same category.
        for category in OFFLOAD_CATEGORIES:
            if not self._offloader.is_offloaded(category):
                self._offloader.clear(category)
                self._offloader.register(category, collect_offload_tensors(self.chunks, self.optimizer, category))

    def offload(self, optimizer: bool = True, grad: bool = True, weights: bool = False) -> dict[str, int]:
        """Move the chosen tensors to host memory and free their device storage (idempotent).

        For co-location with a rollout engine on the same device: the storages are copied
        (into pinned buffers where the accelerator supports them) and resized to 0, so views
        into them stay valid and :meth:`onload` restores them bit for bit. ``update`` onloads
        everything itself; ``compute_logprobs``, ``hf_state`` and ``forward_logits`` onload
        the weights only.

        Args:
            optimizer: the optimizer's state (Adam moments, fp32 master weights and their
                gradients; nothing for a frozen actor).
            grad: the DDP gradient buffers (``grad_data``, which ``param.main_grad`` views).
            weights: the model's parameters (e.g. the frozen reference while the actor trains).

        Returns:
            The bytes moved to the host by this call, per category.
        """
        self._refresh_categories()
        chosen = [name for name, on in (("grad", grad), ("weights", weights), ("optimizer", optimizer)) if on]
        moved = {name: self._offloader.offload(name) for name in chosen}
        get_accelerator().empty_cache()  # hand the freed blocks back to the device for the engine
        logger.debug("offloaded %s", moved)
        return moved

    def onload(self) -> dict[str, int]:
        """Bring back everything :meth:`offload` moved (idempotent).

        Returns:
            The bytes moved back to the device by this call, per category.
        """
        return self._onload_categories(OFFLOAD_CATEGORIES)

    def _onload_categories(self, categories: Sequence[str]) -> dict[str, int]:
        return {name: self._offloader.onload(name) for name in categories}

    def memory(self) -> dict[str, int]:
        """Memory of this rank in bytes, for per-phase logs.

        Returns:
            ``device_allocated`` and ``device_peak`` (the accelerator's counters; on the CPU
            the process' resident set and its peak), ``host_rss``, ``offloaded_bytes`` (on the
            host now, all categories) and ``offloaded_<category>`` for ``grad``, ``weights``
            and ``optimizer``.
        """
        offloaded = self._offloader.offloaded_bytes()
        out = {**memory_snapshot(), "offloaded_bytes": sum(offloaded.values())}
        out.update({f"offloaded_{name}": offloaded.get(name, 0) for name in OFFLOAD_CATEGORIES})
        return out
