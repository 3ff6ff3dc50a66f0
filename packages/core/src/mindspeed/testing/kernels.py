"""Which registry kernels a block of code actually ran: :func:`count_kernel_calls`.

A feature the run report calls "on" must be used by the run (house rule 11). Modules keep the
:class:`~mindspeed.ops.registry.KernelImpl` that ``resolve_kernel`` returned and call it, so
counting calls of ``KernelImpl`` objects counts every kernel a model, an optimizer or a patch
ran, by ``(op, implementation)``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from mindspeed.ops.registry import KernelImpl


@contextlib.contextmanager
def count_kernel_calls() -> Iterator[Counter[tuple[str, str]]]:
    """Count the calls of registry kernels inside the block.

    Yields:
        A ``Counter`` of ``(op, implementation name) -> calls``, filled while the block runs
        (in this process and its threads).
    """
    calls: Counter[tuple[str, str]] = Counter()
    original = KernelImpl.__call__

    def counting(self: KernelImpl, *args: Any, **kwargs: Any) -> Any:
        calls[(self.op, self.name)] += 1
        return original(self, *args, **kwargs)

    KernelImpl.__call__ = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        KernelImpl.__call__ = original  # type: ignore[method-assign]


def calls_of(calls: Counter[tuple[str, str]], op: str) -> int:
    """Calls of any implementation of ``op`` in a :func:`count_kernel_calls` counter."""
    return sum(n for (name, _), n in calls.items() if name == op)
