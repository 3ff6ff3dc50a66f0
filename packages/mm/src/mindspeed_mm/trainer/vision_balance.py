"""The vision encoder's work spread over a Ulysses group: each rank encodes a share of the images and video frames.

The ranks of a sequence-parallel group hold the same microbatch. Instead of each encoding all of
its images and videos, a forward pre-hook on the family's vision encoder
(``VLMFamily.vision_module``) keeps a contiguous share of the call's work, and a forward hook
gathers every tensor of the output (pooled features, hidden states, Qwen3-VL's DeepStack
features) along dimension 0, in order, so the model continues exactly as if this rank had
encoded everything. The gather's backward sums the gradient over the group and keeps this
rank's rows: each rank's vision gradient then covers its own share, for the loss of the whole group.

The unit of work is what the encoder encodes independently:

- an encoder that takes ``grid_thw`` (Qwen-VL) attends within each temporal patch of an image
  or video (transformers' ``get_vision_cu_seqlens``: one attention segment per ``h x w`` frame;
  window attention, rotary and learned positions are per frame too), so a ``[t, h, w]`` grid
  row is ``t`` units of ``h x w`` patches: a video's frames are shared out like images, and one
  long video is split over the group. A rank's share is the rows of ``pixel_values`` of its
  units, with the grid rows they cover (a video cut by the share keeps ``[t', h, w]``);
- otherwise (InternVL) one row of ``pixel_values``: a tile, or a video frame (InternVL's
  frames join the images' tiles in one call).

Each encoder call of the microbatch is shared on its own (Qwen-VL encodes the images, then the
videos, in two calls), balanced by patch count, so each rank encodes about ``1/U`` of the
microbatch's visual patches. A call with fewer units than ranks (one image) is encoded whole on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_mm.models.family import VLMFamily

#: The vision inputs of one encoder call: (pixel rows key, grid key); the encoder is called in this order.
_CALLS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


class _GatherRows(torch.autograd.Function):
    """All-gather of uneven row blocks along dim 0; backward sums over the group and keeps this rank's block."""

    @staticmethod
    def forward(ctx, local, group, sizes, rank):  # type: ignore[override]
        ctx.group, ctx.start, ctx.size = group, sum(sizes[:rank]), sizes[rank]
        longest = max(sizes)
        padded = local.new_zeros(longest, *local.shape[1:])  # gloo's all_gather needs equal sizes
        padded[: local.shape[0]] = local
        buffers = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(buffers, padded.contiguous(), group=group)
        return torch.cat([buffer[:size] for buffer, size in zip(buffers, sizes)])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.start : ctx.start + ctx.size], None, None, None


def shares(weights: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` ranges of ``weights`` (each non-empty), their sums as equal as a greedy cut gets.

    Raises:
        ValueError: fewer items than parts.
    """
    if len(weights) < parts:
        raise ValueError(f"{len(weights)} items cannot be shared by {parts} ranks")
    total, bounds, running, start = sum(weights), [], 0, 0
    for part in range(1, parts):
        target = total * part / parts
        end = start + 1
        running += weights[start]
        # Take more items while that brings the cut closer to the target and leaves one per later part.
        while end < len(weights) - (parts - part) and abs(running + weights[end] - target) <= abs(running - target):
            running += weights[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, len(weights)))
    return bounds


@dataclass(frozen=True)
class CallShare:
    """This rank's share of one encoder call.

    Attributes:
        rows: ``[start, end)`` of the call's ``pixel_values`` rows.
        grid: the grid rows of the share (None: the encoder takes no grid).
        full_rows: the call's rows (identifies the call, with ``full_grid``).
        full_grid: the call's grid (None: no grid).
    """

    rows: tuple[int, int]
    grid: torch.Tensor | None
    full_rows: int
    full_grid: torch.Tensor | None

    def matches(self, pixels: torch.Tensor, grid: torch.Tensor | None) -> bool:
        """Whether an encoder call with these inputs is this share's call."""
        if pixels.shape[0] != self.full_rows or (grid is None) != (self.full_grid is None):
            return False
        return grid is None or torch.equal(grid.cpu(), self.full_grid)


def share_call(pixels: torch.Tensor, grid: torch.Tensor | None, rank: int, size: int) -> CallShare | None:
    """Rank ``rank``'s share of one encoder call over ``size`` ranks (None: fewer units than ranks, encode it whole).

    With a grid, the units are the frames of every grid row (``t`` of ``h x w`` rows each), else the rows.
    """
    if grid is None:
        units = [1] * pixels.shape[0]
    else:
        grid = grid.cpu()
        units = [int(h * w) for t, h, w in grid.tolist() for _ in range(int(t))]
    if len(units) < size:
        return None
    first, last = shares(units, size)[rank]
    rows = (sum(units[:first]), sum(units[:last]))
    local = None
    if grid is not None:
        kept, unit = [], 0
        for t, h, w in grid.tolist():  # the frames of each grid row that fall in [first, last)
            inside = min(unit + t, last) - max(unit, first)
            if inside > 0:
                kept.append([inside, h, w])
            unit += t
        local = torch.tensor(kept, dtype=grid.dtype)
    return CallShare(rows, local, pixels.shape[0], grid)


class VisionBalance:
    """The vision encoder's hooks; call :meth:`begin` with each microbatch's vision inputs before its forward.

    Args:
        model: the (sharded) model.
        family: its family (``vision_module``).
        group: the Ulysses group.
    """

    def __init__(self, model: torch.nn.Module, family: VLMFamily, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.pending: list[CallShare] = []
        self.current: CallShare | None = None
        encoder = model.get_submodule(family.vision_module)
        self.handles = [
            encoder.register_forward_pre_hook(self._split, with_kwargs=True),
            encoder.register_forward_hook(self._gather, with_kwargs=True),
        ]

    @property
    def active(self) -> bool:
        """Whether the next forward shares some encoder call."""
        return bool(self.pending)

    def begin(self, vision: dict[str, torch.Tensor]) -> None:
        """Share the next forward's encoder calls (images, videos; a call with fewer units than ranks: whole)."""
        self.pending, self.current = [], None
        for pixels_key, grid_key in _CALLS:
            pixels = vision.get(pixels_key)
            if pixels is not None:
                share = share_call(pixels, vision.get(grid_key), self.rank, self.size)
                if share is not None:
                    self.pending.append(share)

    def _split(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        pixels = args[0] if args else kwargs.get("pixel_values", kwargs.get("hidden_states"))
        grid = args[1] if len(args) > 1 else kwargs.get("grid_thw")
        # The call's own share (a dummy call of VisionSync, or a call with too few units, has none).
        self.current = next((s for s in self.pending if s.matches(pixels, grid)), None)
        if self.current is None:
            return args, kwargs
        self.pending.remove(self.current)
        lo, hi = self.current.rows
        if args:
            args = (args[0][lo:hi], *args[1:])
        else:
            name = "pixel_values" if "pixel_values" in kwargs else "hidden_states"
            kwargs = {**kwargs, name: kwargs[name][lo:hi]}
        if self.current.grid is not None:
            local = self.current.grid.to(grid.device)
            if len(args) > 1:
                args = (args[0], local, *args[2:])
            else:
                kwargs = {**kwargs, "grid_thw": local}
        return args, kwargs

    def _gather(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if self.current is None:
            return output
        self.current = None
        if isinstance(output, torch.Tensor):
            return self._rows(output)
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor):
                output[key] = self._rows(value)
            elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
                output[key] = type(value)(self._rows(v) for v in value)
        return output

    def _rows(self, local: torch.Tensor) -> torch.Tensor:
        sizes = torch.zeros(self.size, dtype=torch.long, device=local.device)
        sizes[self.rank] = local.shape[0]
        dist.all_reduce(sizes, group=self.group)
        return _GatherRows.apply(local, self.group, sizes.tolist(), self.rank)

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
