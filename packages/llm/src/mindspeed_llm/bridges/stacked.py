"""Hugging Face tensors that hold every expert of a layer at once, seen by the rules one expert at a time.

GPT-OSS keeps a layer's experts stacked: ``mlp.experts.gate_up_proj`` is ``[experts, hidden,
2 * ffn]``, and the released checkpoints store the two projections in MXFP4
(``gate_up_proj_blocks`` + ``gate_up_proj_scales``, see :mod:`mindspeed_llm.bridges.mxfp4`).
megatron holds one tensor per expert, and the rule vocabulary maps one megatron tensor to its
own Hugging Face tensors; so a bridge declares its :class:`StackedTensor` s and

- :class:`StackedCheckpoint` shows a checkpoint to the engine with every stacked tensor split
  into per-expert names (dequantising MXFP4 on the way, one expert at a time);
- :class:`StackingWriter` (the Hugging Face sink's) collects the per-expert tensors of a stacked
  one and writes the stack when its last expert arrives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed.checkpointing.blocks import Blocks
from mindspeed_llm.bridges.mxfp4 import BLOCKS, SCALES, dequantize_mxfp4

Shape = tuple[int, ...]


@dataclass(frozen=True)
class StackedTensor:
    """One stacked Hugging Face tensor template and the per-expert name the rules use.

    Attributes:
        stacked: the checkpoint's name, with ``{layer}`` (``model.layers.{layer}.mlp.experts.down_proj``).
        per_expert: the rules' name, with ``{layer}`` and ``{expert}``.
        mxfp4: the checkpoint may hold it quantised, as ``stacked + '_blocks'`` and ``+ '_scales'``.
    """

    stacked: str
    per_expert: str
    mxfp4: bool = False

    def pattern(self, suffix: str = "") -> re.Pattern[str]:
        """The regular expression of the stacked name (+ ``suffix``), the layer captured."""
        return re.compile(re.escape(self.stacked + suffix).replace(re.escape("{layer}"), r"(\d+)") + "$")

    def expert_name(self, layer: str, expert: int) -> str:
        """The per-expert name of ``expert`` in ``layer``."""
        return self.per_expert.format(layer=layer, expert=expert)


@dataclass(frozen=True)
class _Info:
    dtype: torch.dtype
    shape: Shape
    nbytes: int


@dataclass(frozen=True)
class _Slice:
    source: str  # the stacked tensor's name (or its blocks' name when quantised)
    scales: str | None
    expert: int


class StackedCheckpoint:
    """A checkpoint (``HFCheckpoint``-like: ``tensors``, ``read``) with stacked tensors split per expert.

    Args:
        checkpoint: the checkpoint.
        stacks: the family's stacked tensors.

    Raises:
        ValueError: MXFP4 blocks without their scales (or the other way round).
    """

    def __init__(self, checkpoint: Any, stacks: Iterable[StackedTensor]) -> None:
        self.checkpoint = checkpoint
        self.tensors: dict[str, Any] = {}
        self._slices: dict[str, _Slice] = {}
        stacks = tuple(stacks)
        for name, info in checkpoint.tensors.items():
            if not self._split(name, info, stacks):
                self.tensors[name] = info

    def _split(self, name: str, info: Any, stacks: tuple[StackedTensor, ...]) -> bool:
        for stack in stacks:
            if match := stack.pattern().match(name):
                self._add(stack, match.group(1), name, None, info.dtype, tuple(info.shape))
                return True
            if not stack.mxfp4:
                continue
            if stack.pattern(SCALES).match(name):
                if name[: -len(SCALES)] + BLOCKS not in self.checkpoint.tensors:
                    raise ValueError(f"{name} has no {name[: -len(SCALES)] + BLOCKS} beside it; the MXFP4 pair is cut")
                return True
            if match := stack.pattern(BLOCKS).match(name):
                scales = name[: -len(BLOCKS)] + SCALES
                if scales not in self.checkpoint.tensors:
                    raise ValueError(f"{name} has no {scales} beside it; the MXFP4 pair is cut")
                experts, rows, groups, width = info.shape
                self._add(stack, match.group(1), name, scales, torch.bfloat16, (experts, groups * width * 2, rows))
                return True
        return False

    def _add(self, stack: StackedTensor, layer: str, source: str, scales: str | None, dtype, shape: Shape) -> None:
        per = shape[1:]
        nbytes = dtype.itemsize * int(torch.Size(per).numel())
        for expert in range(shape[0]):
            name = stack.expert_name(layer, expert)
            self.tensors[name] = _Info(dtype, per, nbytes)
            self._slices[name] = _Slice(source, scales, expert)

    def shapes(self) -> dict[str, Shape]:
        """Tensor name -> shape (stacked tensors as their per-expert slices)."""
        return {name: tuple(info.shape) for name, info in self.tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        """One tensor; a per-expert slice of a stacked one (a view of its mapping, or that
        expert's blocks dequantised: the conversion reads a layer's experts interleaved, so
        nothing is cached)."""
        piece = self._slices.get(name)
        if piece is None:
            return self.checkpoint.read(name)
        whole, e = self.checkpoint.read(piece.source), piece.expert
        if piece.scales is None:
            return whole[e]
        return dequantize_mxfp4(whole[e : e + 1], self.checkpoint.read(piece.scales)[e : e + 1])[0]


class StackingWriter:
    """Writes through ``writer`` (``write(name, blocks)``), stacking per-expert tensors first.

    Args:
        writer: the shard writer.
        stacks: the family's stacked tensors.
        counts: experts per stacked name (from :func:`stacked_entries`).
    """

    def __init__(self, writer: Any, stacks: Iterable[StackedTensor], counts: dict[str, int]) -> None:
        self.writer = writer
        self.stacks = tuple(stacks)
        self.counts = counts
        self._pending: dict[str, dict[int, torch.Tensor]] = {}

    def write(self, name: str, blocks: Any) -> None:
        """Write ``name``, or keep it until every expert of its stack is there."""
        target = stacked_target(name, self.stacks)
        if target is None:
            self.writer.write(name, blocks)
            return
        stacked, expert = target
        count = self.counts[stacked]
        pieces = self._pending.setdefault(stacked, {})
        pieces[expert] = blocks.tensor()
        if len(pieces) == count:
            self.writer.write(stacked, Blocks.of(torch.stack([pieces[e] for e in range(count)])))
            del self._pending[stacked]


def _per_expert_pattern(stack: StackedTensor) -> re.Pattern[str]:
    text = re.escape(stack.per_expert)
    text = text.replace(re.escape("{layer}"), r"(?P<layer>\d+)").replace(re.escape("{expert}"), r"(?P<expert>\d+)")
    return re.compile(text + "$")


def stacked_target(name: str, stacks: Iterable[StackedTensor]) -> tuple[str, int] | None:
    """``(stacked name, expert)`` of a per-expert name, or ``None`` for other names."""
    for stack in stacks:
        if match := _per_expert_pattern(stack).match(name):
            return stack.stacked.format(layer=match["layer"]), int(match["expert"])
    return None


def stacked_entries(
    entries: list[tuple[str, torch.dtype, Shape]], stacks: Iterable[StackedTensor]
) -> tuple[list[tuple[str, torch.dtype, Shape]], dict[str, int]]:
    """The writer's ``(name, dtype, shape)`` list with every stack's per-expert entries as one
    ``[experts, ...]`` entry (where its first expert was), and the experts of every stack."""
    stacks = tuple(stacks)
    out: list[tuple[str, torch.dtype, Shape]] = []
    where: dict[str, int] = {}
    for name, dtype, shape in entries:
        target = stacked_target(name, stacks)
        found = None if target is None else target[0]
        if found is None:
            out.append((name, dtype, shape))
            continue
        if found not in where:
            where[found] = len(out)
            out.append((found, dtype, (0, *shape)))
        index = where[found]
        stacked_name, stacked_dtype, stacked_shape = out[index]
        out[index] = (stacked_name, stacked_dtype, (stacked_shape[0] + 1, *stacked_shape[1:]))
    return out, {out[index][0]: out[index][2][0] for index in where.values()}


@dataclass(frozen=True)
class _ShapeOnly:
    dtype: torch.dtype
    shape: Shape


class _StateCheckpoint:
    """An in-memory state dict (or a name -> shape map) as a checkpoint."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state
        self.tensors = {
            name: value if isinstance(value, torch.Tensor) else _ShapeOnly(torch.float32, tuple(value))
            for name, value in state.items()
        }

    def read(self, name: str) -> torch.Tensor:
        return self.state[name]


def unstack_shapes(shapes: Mapping[str, Shape], stacks: Iterable[StackedTensor]) -> dict[str, Shape]:
    """``shapes`` of a checkpoint with its stacked (or MXFP4) tensors as their per-expert slices."""
    stacks = tuple(stacks)
    return StackedCheckpoint(_StateCheckpoint(shapes), stacks).shapes() if stacks else dict(shapes)


def unstack_state(state: Mapping[str, torch.Tensor], stacks: Iterable[StackedTensor]) -> dict[str, torch.Tensor]:
    """An in-memory state dict with its stacked (or MXFP4) tensors as per-expert tensors."""
    stacks = tuple(stacks)
    if not stacks:
        return dict(state)
    view = StackedCheckpoint(_StateCheckpoint(state), stacks)
    return {name: view.read(name) for name in view.tensors}


def stack_state(state: Mapping[str, torch.Tensor], stacks: Iterable[StackedTensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`unstack_state` for per-expert tensors (written stacked, never MXFP4)."""
    stacks = tuple(stacks)
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        target = stacked_target(name, stacks)
        if target is None:
            out[name] = tensor
        else:
            pieces.setdefault(target[0], {})[target[1]] = tensor
    for name, experts in pieces.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out
