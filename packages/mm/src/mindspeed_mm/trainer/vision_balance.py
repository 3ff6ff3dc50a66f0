"""The vision encoder's work spread over a Ulysses group: each rank encodes a share of the images, the features are gathered.

The ranks of a sequence-parallel group hold the same microbatch. Instead of each encoding all of
its images, a forward pre-hook on the family's vision encoder (``VLMFamily.vision_module``)
keeps a contiguous share of the images (balanced by patch count; rows of ``pixel_values`` and
of ``grid_thw`` where the encoder takes one, else one row per tile), and a forward hook gathers
every tensor of the output (pooled features, hidden states, Qwen3-VL's DeepStack features)
along dimension 0, in image order, so the model continues exactly as if this rank had encoded
everything. The gather's backward sums the gradient over the group and keeps this rank's rows:
each rank's vision gradient then covers its own images, for the loss of the whole group.

A microbatch with fewer images (or tiles) than ranks is encoded whole on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mindspeed_mm.models.family import VLMFamily


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


class VisionBalance:
    """The vision encoder's hooks; call :meth:`begin` with each microbatch's vision inputs before its forward.

    Args:
        model: the (sharded) model.
        family: its family (``vision_module``).
        group: the Ulysses group.
    """

    def __init__(self, model: torch.nn.Module, family: VLMFamily, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.active = False
        encoder = model.get_submodule(family.vision_module)
        self.handles = [
            encoder.register_forward_pre_hook(self._split, with_kwargs=True),
            encoder.register_forward_hook(self._gather, with_kwargs=True),
        ]

    def begin(self, vision: dict[str, torch.Tensor]) -> None:
        """Share the next forward's images (none, or fewer than the ranks: every rank encodes them all)."""
        pixels = vision.get("pixel_values")
        grid = vision.get("image_grid_thw")
        rows = [int(g.prod()) for g in grid] if grid is not None else [1] * (0 if pixels is None else pixels.shape[0])
        self.active = len(rows) >= self.size
        if self.active:
            self.images = shares(rows, self.size)[self.rank]
            self.rows = (sum(rows[: self.images[0]]), sum(rows[: self.images[1]]))

    def _split(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if not self.active:
            return args, kwargs
        (lo, hi), (first, last) = self.rows, self.images
        if args:
            args = (args[0][lo:hi], *args[1:])
        else:
            name = "pixel_values" if "pixel_values" in kwargs else "hidden_states"
            kwargs = {**kwargs, name: kwargs[name][lo:hi]}
        if kwargs.get("grid_thw") is not None:
            kwargs = {**kwargs, "grid_thw": kwargs["grid_thw"][first:last]}
        return args, kwargs

    def _gather(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not self.active:
            return output
        self.active = False  # one encoder call per microbatch: a second one (the dummy pass) is not split
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
