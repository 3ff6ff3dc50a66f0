"""Patch embeddings as one matmul: convolutions whose stride is their kernel, run as a linear layer.

A vision tower's patch embedding is a ``Conv2d`` / ``Conv3d`` whose kernel tiles its input
without overlap (Qwen2.5-VL and Qwen3-VL: a ``Conv3d`` over inputs exactly one patch large;
InternVL: a ``Conv2d`` over whole tiles). That is a matmul of the patches by the flattened
kernel, but the CPU's convolution kernel computes it about 3x slower, forward and backward
(2,500 patches of 1,176 values to 256 channels, one thread: 127 ms against 39 ms).

:func:`use_linear_patches` changes the class of each such module to a subclass whose forward
cuts the input into its patches and multiplies them by the kernel (the way FSDP2 changes a
module's class; no module of transformers is edited): the parameters, their names and the
state dict stay the convolution's. Inputs that the kernel does not tile go to the convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _patches_forward(conv: nn.Conv2d | nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """The convolution of ``x`` ([batch, channels, *spatial]) as patches @ kernel, or the convolution itself."""
    kernel, dims = tuple(conv.kernel_size), len(conv.kernel_size)
    spatial = tuple(x.shape[-dims:])
    if x.dim() != dims + 2 or any(s % k for s, k in zip(spatial, kernel)):
        return conv._conv_forward(x, conv.weight, conv.bias)
    batch, channels = x.shape[:2]
    counts = [s // k for s, k in zip(spatial, kernel)]
    weight = conv.weight.reshape(conv.out_channels, -1)
    if all(n == 1 for n in counts):  # one patch per row (Qwen-VL): no reordering
        out = F.linear(x.reshape(batch, -1), weight, conv.bias)
        return out.view(batch, conv.out_channels, *counts)
    # [b, c, n1, k1, n2, k2, ...] -> [b, n1, n2, ..., c, k1, k2, ...]
    split = x.reshape(batch, channels, *[v for n, k in zip(counts, kernel) for v in (n, k)])
    order = [0, *range(2, 2 + 2 * dims, 2), 1, *range(3, 3 + 2 * dims, 2)]
    patches = split.permute(order).reshape(-1, weight.shape[1])
    out = F.linear(patches, weight, conv.bias).view(batch, *counts, conv.out_channels)
    return out.permute(0, dims + 1, *range(1, dims + 1))


class LinearPatchConv2d(nn.Conv2d):
    """A ``Conv2d`` whose stride is its kernel, computed as a matmul of the patches (see the module doc)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return _patches_forward(self, input)


class LinearPatchConv3d(nn.Conv3d):
    """A ``Conv3d`` whose stride is its kernel, computed as a matmul of the patches (see the module doc)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return _patches_forward(self, input)


_SWAPS = {nn.Conv2d: LinearPatchConv2d, nn.Conv3d: LinearPatchConv3d}


def _tiles(conv: nn.Module) -> bool:
    """Whether ``conv`` cuts its input into non-overlapping patches: stride = kernel, no padding, dilation or groups."""
    return (
        tuple(conv.stride) == tuple(conv.kernel_size)
        and all(p == 0 for p in conv.padding)
        and all(d == 1 for d in conv.dilation)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
    )


def use_linear_patches(model: nn.Module) -> list[str]:
    """Run every patch-tiling ``Conv2d`` / ``Conv3d`` of ``model`` as a matmul; returns the changed modules' names."""
    changed = []
    for name, module in model.named_modules():
        swap = _SWAPS.get(type(module))
        if swap is not None and _tiles(module):
            module.__class__ = swap
            changed.append(name)
    return changed
