"""Tensor bytes at file offsets: write a tensor given as views (:class:`~mindspeed.checkpointing.blocks.Blocks`),
map a byte range of a file as a tensor (:func:`map_file_range`).

Every byte goes to the file with ``pwritev`` straight from where it lies: the kernel copies it
once, from the source's page cache (through the source's mapping) into the output's. A contiguous
view is one buffer; a column range of a row-parallel weight, or pieces glued side by side, is
one buffer per row (``pwritev`` takes up to IOV_MAX of them per call). Only rows shorter than
:data:`MIN_RUN_BYTES` (where a buffer per row would cost more than a copy) are first gathered,
a bounded number of rows at a time, into one reused scratch buffer: memory that is already
resident, never a fresh allocation per tensor.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from mindspeed.checkpointing.blocks import Blocks

#: Bytes of the gather buffer (rows are gathered in batches of at most this size; a single row
#: larger than it gets a buffer of its own size).
SCRATCH_BYTES = 32 * 2**20
#: Rows at least this long are written from where they lie, one buffer each; shorter ones are gathered.
MIN_RUN_BYTES = 512
#: Buffers per ``pwritev`` call (the kernel's IOV_MAX) and bytes per call (Linux writes at most
#: 0x7ffff000 bytes per call).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_CALL_BYTES = 1 << 30

_scratch: torch.Tensor | None = None


def map_file_range(path: str | Path, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` of ``path`` from ``offset`` as a 1-D ``dtype`` tensor backed by a private file mapping.

    Reading through the page cache's own pages saves a copy and the page faults of a fresh
    buffer; the mapping lives as long as the tensor (or a view of it) and is unmapped with it,
    so resident memory stays the tensors in flight, not the files read.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    fd = os.open(path, os.O_RDONLY)
    try:
        # Copy-on-write: the tensor is writable (no warning) without ever writing to the file.
        mapping = mmap.mmap(fd, offset - start + nbytes, offset=start, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset - start)
    if (offset - start) % dtype.itemsize:
        raw = raw.clone()  # misaligned for the element type: one aligned copy
    return raw.view(dtype)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of the contiguous ``tensor`` as a memoryview (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _storage_view(tensor: torch.Tensor) -> memoryview:
    # All bytes of the tensor's storage (the whole mapping of a mapped tensor), no copy.
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(flat.numpy())


def _row_runs(block: list[torch.Tensor]) -> list[memoryview] | None:
    # The block's bytes as one buffer per (row, view) when every view's rows are contiguous and
    # long enough, interleaved row by row as the block's rows are; else None.
    runs_per_view = []
    for view in block:
        if view.dim() < 2:
            return None
        row = view[0]
        run = row.numel() * view.element_size()
        if run < MIN_RUN_BYTES or not row.is_contiguous():
            return None
        storage = _storage_view(view)
        start, step = view.storage_offset() * view.element_size(), view.stride(0) * view.element_size()
        runs_per_view.append([storage[start + r * step : start + r * step + run] for r in range(view.shape[0])])
    return [run for row in zip(*runs_per_view) for run in row]


def _scratch_bytes(nbytes: int) -> torch.Tensor:
    global _scratch
    if _scratch is None or _scratch.numel() < nbytes:
        _scratch = torch.empty(max(nbytes, SCRATCH_BYTES), dtype=torch.uint8)
    return _scratch[:nbytes]


def pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Write ``buffers`` back to back at ``offset`` of ``fd`` (short writes resumed); returns the bytes."""
    pending = [b for b in buffers if len(b)]
    total, index = 0, 0
    while index < len(pending):
        batch = pending[index : index + _IOV_MAX]
        size = sum(map(len, batch))
        if size > _CALL_BYTES:  # keep one call under the kernel's limit
            batch, size = _trim(batch)
        done = os.pwritev(fd, batch, offset + total)
        total += done
        if done == size and len(batch[-1]) == len(pending[index + len(batch) - 1]):
            index += len(batch)
            continue
        # A short write, or a buffer cut by _trim: resume after the last byte written.
        for _ in batch:
            if done < len(pending[index]):
                pending[index] = pending[index][done:]
                break
            done -= len(pending[index])
            index += 1
    return total


def _trim(batch: list[memoryview]) -> tuple[list[memoryview], int]:
    # The longest prefix of ``batch`` within _CALL_BYTES (its first buffer cut when it alone is longer).
    size = 0
    for count, buffer in enumerate(batch):
        if size + len(buffer) > _CALL_BYTES:
            if count == 0:
                return [buffer[:_CALL_BYTES]], _CALL_BYTES
            return batch[:count], size
        size += len(buffer)
    return batch, size


def write_blocks(fd: int, offset: int, data: Blocks | torch.Tensor) -> int:
    """Write the bytes of ``data`` (row-major, as ``data.tensor()`` would hold them) at ``offset``.

    Args:
        fd: a file descriptor open for writing.
        offset: where the first byte goes.
        data: the tensor, or the views that make it up.

    Returns:
        The bytes written.
    """
    blocks = data if isinstance(data, Blocks) else Blocks.of(data.detach().cpu())
    position = offset
    ready: list[memoryview] = []
    for block in blocks.parts:
        if len(block) == 1 and block[0].is_contiguous():
            ready.append(byte_view(block[0]))
            continue
        runs = _row_runs(block)
        if runs is not None:
            ready += runs
            continue
        position += pwrite_all(fd, ready, position)
        ready = []
        position += _write_gathered(fd, position, block)
    return position + pwrite_all(fd, ready, position) - offset


def _write_gathered(fd: int, offset: int, block: list[torch.Tensor]) -> int:
    # Rows of the block, a batch at a time, copied into the scratch buffer, then written.
    rows = block[0].shape[0] if block[0].dim() else 1
    width = sum(view.shape[1] for view in block) if len(block) > 1 else None
    row_shape = (width, *block[0].shape[2:]) if width is not None else tuple(block[0].shape[1:])
    dtype = block[0].dtype
    row_bytes = dtype.itemsize
    for size in row_shape:
        row_bytes *= size
    if block[0].dim() == 0 or row_bytes == 0:
        return pwrite_all(fd, [byte_view(block[0].contiguous())], offset)
    step = max(1, SCRATCH_BYTES // row_bytes)
    written = 0
    for start in range(0, rows, step):
        count = min(step, rows - start)
        out = _scratch_bytes(count * row_bytes).view(dtype).view(count, *row_shape)
        column = 0
        for view in block:
            if len(block) == 1:
                out.copy_(view[start : start + count])
            else:
                out[:, column : column + view.shape[1]].copy_(view[start : start + count])
                column += view.shape[1]
        written += pwrite_all(fd, [byte_view(out)], offset + written)
    return written
