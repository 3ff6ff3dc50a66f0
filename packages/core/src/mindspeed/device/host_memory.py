"""How the process's C heap (glibc's malloc) treats freed host memory: keep it for the next step.

By default glibc serves blocks above a threshold (128 KiB, raised on the fly up to 32 MiB) with their
own ``mmap`` and gives them back to the kernel on free, and trims the heap's free top. A training step
on the CPU frees its activations and allocates them again in the next step: each time the kernel hands
out fresh zeroed pages, a minor page fault per 4 KiB. Measured on a 4.9 M-parameter Wan with compiled
blocks (docs/mm/dit-parallelism.md): 17 k faults and ~58 ms of a 0.55 s step (kernel and user time),
the same peak RSS without them. :func:`retain_freed_host_memory` raises both thresholds so that freed
blocks stay in the heap for reuse (what the allocators that CPU training launchers preload, jemalloc
and tcmalloc, do by design). A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from collections.abc import Iterator
from contextlib import contextmanager

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: glibc's ``mallopt`` parameters (malloc.h) and their documented defaults.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
DEFAULT_TRIM_THRESHOLD = DEFAULT_MMAP_THRESHOLD = 128 * 1024
#: What the thresholds become on exit: where glibc's on-the-fly raising ends on 64-bit hosts
#: (``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB; the trim threshold twice the mmap threshold, as that raising sets it).
#: Any ``mallopt`` of the mmap threshold turns the raising off for good, so restoring the 128 KiB defaults would
#: leave the process mapping and faulting in every block above 128 KiB for the rest of its life (measured: a
#: Flow-GRPO run after an in-process ``mindspeed-mm train`` took 287 s instead of ~140 s, half of it in the kernel).
EXIT_MMAP_THRESHOLD, EXIT_TRIM_THRESHOLD = 32 * 2**20, 64 * 2**20


def _mallopt() -> ctypes._CFuncPtr | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    mallopt = ctypes.CDLL(name).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


@contextmanager
def retain_freed_host_memory(
    enabled: bool = True, mmap_threshold: int = 256 * 2**20, trim_threshold: int = 2**30
) -> Iterator[bool]:
    """Inside the block, freed host blocks below ``mmap_threshold`` bytes stay in the heap (up to ``trim_threshold``
    bytes of free top are kept too).

    Yields:
        whether the setting is on (False: ``enabled`` false, or not glibc).

    On exit the thresholds become :data:`EXIT_MMAP_THRESHOLD` / :data:`EXIT_TRIM_THRESHOLD`, where glibc's own
    on-the-fly raising of them ends (which any ``mallopt`` of the mmap threshold turns off for good): blocks above
    32 MiB are mapped afresh again, smaller ones reused, as in a process that never called this.
    """
    mallopt = _mallopt() if enabled else None
    if mallopt is None:
        yield False
        return
    if not (mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, trim_threshold)):
        logger.warning("host memory: glibc's mallopt refused the thresholds; freed memory goes back to the kernel")
        mallopt(M_MMAP_THRESHOLD, EXIT_MMAP_THRESHOLD)
        yield False
        return
    logger.info(
        "host memory: freed blocks stay in the heap (mmap threshold %d MiB, trim threshold %d MiB)",
        mmap_threshold >> 20,
        trim_threshold >> 20,
    )
    try:
        yield True
    finally:
        mallopt(M_MMAP_THRESHOLD, EXIT_MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, EXIT_TRIM_THRESHOLD)
