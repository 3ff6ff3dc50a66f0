"""The replay buffer as a Ray actor, and a client with the same (blocking) API.

The actor is threaded (``max_concurrency`` > 1): a producer blocked in ``allocate`` or a
consumer blocked in ``wait_ready`` holds one of its threads while the others keep serving
``put`` / ``mark_consumed``, which is what unblocks them. Ray is imported only when an actor is
made, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mindspeed_rl.buffer.replay import ReplayBuffer


def create_buffer_actor(
    columns: Sequence[str],
    rows_per_step: int,
    max_staleness: int = 0,
    mode: str | None = None,
    *,
    name: str | None = None,
    max_concurrency: int = 32,
    num_cpus: float = 0,
    **options: Any,
) -> Any:
    """Start a :class:`ReplayBuffer` as a Ray actor (``ray.init`` must have run).

    Args:
        columns, rows_per_step, max_staleness, mode: as for :class:`ReplayBuffer`.
        name: a Ray actor name, so other workers can find it with ``ray.get_actor``.
        max_concurrency: threads serving calls at once (blocking waits each hold one).
        num_cpus: CPU reservation of the actor (0: it mostly waits).
        options: more ``ActorClass.options`` (e.g. ``namespace``, ``lifetime``).

    Returns:
        The actor handle.
    """
    import ray

    actor_class = ray.remote(ReplayBuffer)
    return actor_class.options(name=name, max_concurrency=max_concurrency, num_cpus=num_cpus, **options).remote(
        list(columns), rows_per_step, max_staleness, mode
    )


class BufferClient:
    """Calls a buffer actor as if it were a local :class:`ReplayBuffer` (each call waits for its result).

    Exceptions raised in the actor (``StalenessError``, ``TimeoutError``, ``ValueError``) come
    back as Ray errors that are also instances of the original class.

    Args:
        handle: the actor handle from :func:`create_buffer_actor` or ``ray.get_actor``.
    """

    _METHODS = frozenset(
        {
            "get_version",
            "advance_version",
            "can_allocate",
            "allocate",
            "put",
            "discard",
            "ready_count",
            "wait_ready",
            "get",
            "mark_consumed",
            "clear",
            "close",
            "stats",
        }
    )

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        if name not in self._METHODS:
            raise AttributeError(f"ReplayBuffer has no method {name!r}")
        import ray

        method = getattr(self.handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return ray.get(method.remote(*args, **kwargs))

        call.__name__ = name
        return call
