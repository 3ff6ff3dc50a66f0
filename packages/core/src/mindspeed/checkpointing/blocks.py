"""Tensors assembled from views of other tensors, without copying them into one buffer.

A conversion mostly rearranges bytes: megatron's fused QKV is, per query group, rows of the
Hugging Face q, k and v projections; a tensor-parallel piece of a row-parallel weight is a
column range of every row; gluing pieces back is the reverse. :class:`Blocks` describes such a
tensor as row blocks stacked along dim 0, each block one view (or several views side by side
along dim 1), so that cutting and gluing stay views, and a writer can send each view's bytes
straight from the source mapping to the output file (one copy, done by the kernel), instead of
materialising the fused tensor and then its pieces (two more copies into fresh memory, which
costs more than the write itself on hosts where new pages are expensive).

:meth:`Blocks.tensor` materialises the tensor when a caller needs one (LoRA merging, the
in-memory dist format, tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Blocks:
    """A tensor given as row blocks, each block a list of views side by side along dim 1.

    Args:
        parts: the row blocks, top to bottom; every view of a block has the same rows (dim 0)
            and every block the same width and trailing dims.

    Raises:
        ValueError: no blocks, or blocks whose dtypes or trailing shapes disagree.
    """

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]]) -> None:
        self.parts = [list(block) for block in parts if block and block[0].shape[:1] != (0,)]
        if not self.parts:
            # Keep one (empty) block, so that shape and dtype stay known.
            first = next((block for block in parts if block), None)
            if first is None:
                raise ValueError("Blocks needs at least one view")
            self.parts = [list(first)]
        head = self._block_shape(self.parts[0])
        self.dtype = self.parts[0][0].dtype
        for block in self.parts:
            if self._block_shape(block)[1:] != head[1:] or any(view.dtype != self.dtype for view in block):
                raise ValueError(f"blocks of shapes {head} and {self._block_shape(block)} cannot be stacked")
        self.shape = (sum(self._block_shape(block)[0] for block in self.parts), *head[1:]) if head else ()

    @staticmethod
    def _block_shape(block: list[torch.Tensor]) -> tuple[int, ...]:
        first = tuple(block[0].shape)
        if len(block) == 1:
            return first
        if any(view.dim() < 2 or view.shape[0] != first[0] or view.shape[2:] != block[0].shape[2:] for view in block):
            raise ValueError(f"views of shapes {[tuple(v.shape) for v in block]} cannot sit side by side")
        return (first[0], sum(view.shape[1] for view in block), *first[2:])

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Blocks:
        """One tensor as a single block."""
        return cls([[tensor]])

    @classmethod
    def stack(cls, items: Sequence[Blocks]) -> Blocks:
        """``items`` stacked along dim 0 (``torch.cat`` without the copy)."""
        return cls([block for item in items for block in item.parts])

    @property
    def numel(self) -> int:
        """Elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        """Bytes of the elements."""
        return self.numel * self.dtype.itemsize

    def rows(self, start: int, stop: int) -> Blocks:
        """Rows ``[start, stop)`` (dim 0), as views."""
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) of a tensor with {self.shape[0]} rows")
        out, offset = [], 0
        for block in self.parts:
            rows = block[0].shape[0]
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                out.append([view[lo - offset : hi - offset] for view in block])
            offset += rows
        return Blocks(out or [[view[:0] for view in self.parts[0]]])

    def columns(self, start: int, stop: int) -> Blocks:
        """Columns ``[start, stop)`` (dim 1) of every row, as (strided) views."""
        if len(self.shape) < 2 or not 0 <= start <= stop <= self.shape[1]:
            raise ValueError(f"columns [{start}, {stop}) of a tensor of shape {self.shape}")
        out = []
        for block in self.parts:
            views, offset = [], 0
            for view in block:
                width = view.shape[1]
                lo, hi = max(start, offset), min(stop, offset + width)
                if lo < hi:
                    views.append(view[:, lo - offset : hi - offset])
                offset += width
            out.append(views or [block[0][:, :0]])
        return Blocks(out)

    def tensor(self) -> torch.Tensor:
        """The tensor itself (a view when it is one view, else a new contiguous tensor)."""
        rows = [block[0] if len(block) == 1 else torch.cat(block, dim=1) for block in self.parts]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def __repr__(self) -> str:
        return f"Blocks(shape={self.shape}, dtype={self.dtype}, blocks={len(self.parts)})"
