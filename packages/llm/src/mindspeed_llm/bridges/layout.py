"""Parallel layouts: where each parameter of the unsharded megatron model lives, and in what piece.

A :class:`ParallelLayout` (tensor, pipeline, expert and virtual-pipeline sizes, or an explicit
``num_layer_list``) places every :class:`~mindspeed_llm.bridges.megatron_params.MegatronParam`
on the ranks that hold it (:meth:`ParallelLayout.place`), cuts the full tensor into the
tensor-parallel pieces (:func:`split_tensor`) and glues them back (:func:`merge_tensors`),
following megatron's own rules:

- column-parallel weights and their biases are cut along dim 0, row-parallel weights along dim 1;
- a gated ``linear_fc1`` (``[gate; up]``) gives rank r ``[gate_r; up_r]``;
- embedding and output layer rows are cut after padding the vocabulary to a multiple of TP;
- pipeline stages own consecutive layer ranges (``num_layer_list`` or equal shares); with
  virtual stages, model chunk i of pipeline rank p owns global chunk ``i * pp + p``; DualPipeV's
  V (``dualpipev``): rank p owns global chunks ``p`` and ``2 pp - 1 - p``, and the final norm and
  the output layer sit on rank 0's second chunk;
- expert-parallel rank e owns experts ``[e * E / ep, (e + 1) * E / ep)``, renumbered from 0;
- a tied output layer is a copy of the embedding on the last stage when PP > 1;
- multi-token-prediction layers (``mtp.layers.N``) sit on the last stage, with a copy of the
  embedding there when PP > 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mindspeed.checkpointing.blocks import Blocks
from mindspeed_llm.bridges.megatron_params import MegatronParam, Split
from mindspeed_llm.bridges.shape import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


class RankKey(NamedTuple):
    """A model-parallel rank: tensor, pipeline and expert parallel indices."""

    tp: int
    pp: int
    ep: int


class Piece(NamedTuple):
    """Where one tensor-parallel piece of a parameter goes.

    Attributes:
        rank: the rank holding it.
        chunk: the virtual pipeline model chunk (0 without VPP).
        name: the parameter's name in that chunk's state dict (local layer and expert indices).
        tp_index: which tensor-parallel piece (``split_tensor(...)[tp_index]``).
    """

    rank: RankKey
    chunk: int
    name: str
    tp_index: int


@dataclass(frozen=True)
class ParallelLayout:
    """A megatron model-parallel layout (data parallelism does not change checkpoints).

    Attributes:
        tp: tensor-parallel size (experts are cut by the same size).
        pp: pipeline-parallel size.
        ep: expert-parallel size.
        vpp_layers: layers per virtual pipeline stage (``--num-layers-per-virtual-pipeline-stage``).
        num_layer_list: layers of each pipeline stage (``--num-layer-list``), for uneven stages.
        dualpipev: DualPipeV's V (``mindspeed.megatron.dualpipev``): ``2 pp`` equal chunks, rank
            ``p`` holding chunks ``p`` and ``2 pp - 1 - p`` (megatron's VPP=2 numbering, mirrored).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp_layers: int | None = None
    num_layer_list: tuple[int, ...] | None = None
    dualpipev: bool = False

    def check(self, shape: ModelShape) -> None:
        """Raise a ``ValueError`` naming the flag and the model size that do not fit.

        Args:
            shape: the model the layout is for.
        """
        flag_tp, flag_pp, flag_ep = (
            "--target-tensor-parallel-size",
            "--target-pipeline-parallel-size",
            "--target-expert-parallel-size",
        )
        for flag, size in ((flag_tp, self.tp), (flag_pp, self.pp), (flag_ep, self.ep)):
            if size < 1:
                raise ValueError(f"{flag} must be at least 1, got {size}")
        if shape.multi_latent_attention:
            dims = {"num_attention_heads": shape.num_attention_heads}
            if shape.q_lora_rank:
                dims["q_lora_rank"] = shape.q_lora_rank
            dims["kv_lora_rank + qk_rope_head_dim"] = shape.kv_lora_rank + shape.qk_pos_emb_head_dim
        else:
            dims = {"num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_query_groups}
        if any(not shape.is_moe_layer(i) for i in range(shape.num_layers)):
            dims["intermediate_size"] = shape.ffn_hidden_size
        if shape.mtp_num_layers:
            dims["hidden_size (multi-token-prediction eh_proj)"] = shape.hidden_size
        if shape.num_experts:
            dims["moe_intermediate_size"] = shape.moe_ffn_hidden_size
            if shape.moe_shared_expert_intermediate_size:
                dims["shared expert intermediate_size"] = shape.moe_shared_expert_intermediate_size
        for what, value in dims.items():
            if value % self.tp:
                raise ValueError(
                    f"{flag_tp} {self.tp} does not divide {what} {value} of the model; "
                    f"pick a tensor-parallel size that divides it"
                )
        self._check_layers(shape, flag_pp)
        if self.ep > 1 and not shape.num_experts:
            raise ValueError(f"{flag_ep} {self.ep} needs a mixture-of-experts model; this one is dense")
        if shape.num_experts and shape.num_experts % self.ep:
            raise ValueError(f"{flag_ep} {self.ep} does not divide the {shape.num_experts} experts")

    def _check_layers(self, shape: ModelShape, flag_pp: str) -> None:
        layers = shape.num_layers
        if self.num_layer_list is not None:
            if self.vpp_layers:
                raise ValueError("--num-layer-list and --num-layers-per-virtual-pipeline-stage exclude each other")
            if (
                len(self.num_layer_list) != self.pp
                or sum(self.num_layer_list) != layers
                or min(self.num_layer_list) < 1
            ):
                raise ValueError(
                    f"--num-layer-list {','.join(map(str, self.num_layer_list))} must give {self.pp} "
                    f"positive layer counts (one per pipeline stage) summing to {layers}"
                )
        elif layers % self.pp:
            raise ValueError(
                f"{flag_pp} {self.pp} does not divide the {layers} layers; pass --num-layer-list "
                f"with {self.pp} layer counts summing to {layers}"
            )
        if self.vpp_layers:
            if self.pp < 2:
                raise ValueError("--num-layers-per-virtual-pipeline-stage needs a pipeline-parallel size of 2 or more")
            if layers % (self.pp * self.vpp_layers):
                raise ValueError(
                    f"--num-layers-per-virtual-pipeline-stage {self.vpp_layers} times {flag_pp} "
                    f"{self.pp} does not divide the {layers} layers"
                )

    def num_chunks(self, shape: ModelShape) -> int:
        """Model chunks per pipeline rank (1 without virtual stages)."""
        if self.dualpipev:
            return 2
        return shape.num_layers // (self.pp * self.vpp_layers) if self.vpp_layers else 1

    def ranks(self) -> list[RankKey]:
        """Every model-parallel rank, pipeline-major, then expert, then tensor."""
        return [RankKey(t, p, e) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def layer_place(self, shape: ModelShape, layer: int) -> tuple[int, int, int]:
        """(pipeline rank, model chunk, local index) of global ``layer``."""
        if self.dualpipev:
            chunk, local = divmod(layer, shape.num_layers // (2 * self.pp))
            return (chunk, 0, local) if chunk < self.pp else (2 * self.pp - 1 - chunk, 1, local)
        if self.vpp_layers:
            chunk, local = divmod(layer, self.vpp_layers)
            return chunk % self.pp, chunk // self.pp, local
        counts = self.num_layer_list or (shape.num_layers // self.pp,) * self.pp
        start = 0
        for stage, count in enumerate(counts):
            if layer < start + count:
                return stage, 0, layer - start
            start += count
        raise ValueError(f"layer {layer} is outside the model's {shape.num_layers} layers")

    def first_stage(self) -> tuple[int, int]:
        """(pipeline rank, chunk) holding the embedding."""
        return 0, 0

    def last_stage(self, shape: ModelShape) -> tuple[int, int]:
        """(pipeline rank, chunk) holding the final norm and the output layer."""
        if self.dualpipev:
            return 0, 1
        return self.pp - 1, self.num_chunks(shape) - 1

    def place(self, param: MegatronParam, shape: ModelShape) -> list[Piece]:
        """Every piece of ``param`` in this layout.

        Args:
            param: a parameter of the unsharded model.
            shape: the model.

        Returns:
            One :class:`Piece` per rank holding (a piece of) it; non-expert parameters appear on
            every expert-parallel rank of their stage.
        """
        name = param.name
        if param.layer is not None:
            stage, chunk, local = self.layer_place(shape, param.layer)
            name = _LAYER.sub(f"decoder.layers.{local}.", name, count=1)
        elif name.startswith("embedding."):
            stage, chunk = self.first_stage()
        else:
            stage, chunk = self.last_stage(shape)
        eps = range(self.ep)
        if param.expert is not None:
            per_rank = shape.num_experts // self.ep
            owner, local_expert = divmod(param.expert, per_rank)
            eps = [owner]
            name = _EXPERT.sub(f".local_experts.{local_expert}.", name, count=1)
        pieces = [Piece(RankKey(t, stage, e), chunk, name, t) for e in eps for t in range(self.tp)]
        if name == "embedding.word_embeddings.weight" and self.pp > 1:
            stage, chunk = self.last_stage(shape)
            copies = ["output_layer.weight"] if shape.tie_embeddings else []
            if shape.mtp_num_layers:
                copies.append(name)
            # megatron keeps a copy of the tied embedding as the last stage's output layer, and the
            # multi-token-prediction layers (on the last stage) a copy of the embedding.
            pieces += [
                Piece(RankKey(t, stage, e), chunk, copy, t) for copy in copies for e in eps for t in range(self.tp)
            ]
        return pieces

    def describe(self) -> str:
        """Short label, e.g. ``tp2-pp2-vpp1`` or ``tp1-pp2[3,1]-ep2``."""
        pp = f"pp{self.pp}" + (f"[{','.join(map(str, self.num_layer_list))}]" if self.num_layer_list else "")
        vpp = f"-vpp{self.vpp_layers}" if self.vpp_layers else ("-dualpipev" if self.dualpipev else "")
        return f"tp{self.tp}-{pp}{vpp}-ep{self.ep}"


def _padded_rows(rows: int, tp: int) -> int:
    return -(-rows // tp) * tp


def split_tensor(param: MegatronParam, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The ``tp`` tensor-parallel pieces of the full ``tensor`` of ``param`` (views where possible).

    Raises:
        ValueError: the split dimension is not divisible by ``tp``.
    """
    if tp == 1 or param.split is Split.REPLICATED:
        return [tensor] * tp
    if param.split is Split.VOCAB:
        rows = tensor.shape[0]
        if rows % tp:
            pad = tensor.new_zeros((_padded_rows(rows, tp) - rows, *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        return list(tensor.chunk(tp, dim=0))
    dim = 1 if param.split is Split.ROW else 0
    if tensor.shape[dim] % (2 * tp if param.split is Split.GLU else tp):
        raise ValueError(
            f"{param.name}: dim {dim} of size {tensor.shape[dim]} cannot be cut in {tp} tensor-parallel pieces"
        )
    if param.split in (Split.GLU, Split.SECTIONS):
        parts = [part.chunk(tp) for part in tensor.split(list(_sections(param, tp)), dim=0)]
        return [torch.cat([part[index] for part in parts]) for index in range(tp)]
    return list(tensor.chunk(tp, dim=dim))


def _sections(param: MegatronParam, tp: int) -> tuple[int, ...]:
    """Row counts of the sections of a GLU / SECTIONS parameter, each checked to cut in ``tp`` blocks."""
    sections = param.sections or (param.shape[0] // 2,) * 2
    if any(size % tp for size in sections):
        raise ValueError(f"{param.name}: sections {list(sections)} cannot each be cut in {tp} tensor-parallel pieces")
    return sections


def merge_tensors(param: MegatronParam, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of ``param`` from its tensor-parallel ``pieces`` (inverse of :func:`split_tensor`).

    Raises:
        ValueError: replicated pieces differ (the checkpoint's ranks disagree).
    """
    if len(pieces) == 1:
        return pieces[0]
    if param.split is Split.REPLICATED:
        for index, piece in enumerate(pieces[1:], 1):
            if not torch.equal(piece, pieces[0]):
                raise ValueError(f"{param.name}: tensor-parallel rank {index} holds a different copy than rank 0")
        return pieces[0]
    if param.split is Split.VOCAB:
        return torch.cat(pieces)[: param.shape[0]]
    if param.split in (Split.GLU, Split.SECTIONS):
        local = [size // len(pieces) for size in _sections(param, len(pieces))]
        parts = [piece.split(local, dim=0) for piece in pieces]
        return torch.cat([part[index] for index in range(len(local)) for part in parts])
    return torch.cat(pieces, dim=1 if param.split is Split.ROW else 0)


def split_blocks(param: MegatronParam, blocks: Blocks, tp: int) -> list[Blocks]:
    """:func:`split_tensor` as views: the ``tp`` pieces of the full tensor given as ``blocks``.

    Raises:
        ValueError: the split dimension is not divisible by ``tp``.
    """
    if tp == 1 or param.split is Split.REPLICATED:
        return [blocks] * tp
    rows = blocks.shape[0]
    if param.split is Split.VOCAB:
        per = _padded_rows(rows, tp) // tp
        pieces = []
        for index in range(tp):
            piece = blocks.rows(min(index * per, rows), min((index + 1) * per, rows))
            if piece.shape[0] < per:  # the padding rows megatron adds to the last ranks, zeros
                pad = torch.zeros((per - piece.shape[0], *blocks.shape[1:]), dtype=blocks.dtype)
                piece = Blocks.stack([piece, Blocks.of(pad)])
            pieces.append(piece)
        return pieces
    dim = 1 if param.split is Split.ROW else 0
    if blocks.shape[dim] % (2 * tp if param.split is Split.GLU else tp):
        raise ValueError(
            f"{param.name}: dim {dim} of size {blocks.shape[dim]} cannot be cut in {tp} tensor-parallel pieces"
        )
    if param.split is Split.ROW:
        per = blocks.shape[1] // tp
        return [blocks.columns(index * per, (index + 1) * per) for index in range(tp)]
    if param.split in (Split.GLU, Split.SECTIONS):
        sections = _sections(param, tp)
        starts = [sum(sections[:i]) for i in range(len(sections))]
        return [
            Blocks.stack(
                [
                    blocks.rows(start + index * (size // tp), start + (index + 1) * (size // tp))
                    for start, size in zip(starts, sections)
                ]
            )
            for index in range(tp)
        ]
    per = rows // tp
    return [blocks.rows(index * per, (index + 1) * per) for index in range(tp)]


def merge_blocks(param: MegatronParam, pieces: list[torch.Tensor]) -> Blocks:
    """:func:`merge_tensors` as views: the full tensor of ``param`` glued from its ``pieces``.

    Raises:
        ValueError: replicated pieces differ (the checkpoint's ranks disagree).
    """
    if len(pieces) == 1 or param.split is Split.REPLICATED:
        return Blocks.of(merge_tensors(param, pieces))
    if param.split is Split.ROW:
        return Blocks([pieces])
    if param.split in (Split.GLU, Split.SECTIONS):
        local = [size // len(pieces) for size in _sections(param, len(pieces))]
        parts = [piece.split(local, dim=0) for piece in pieces]
        return Blocks([[part[index]] for index in range(len(local)) for part in parts])
    blocks = Blocks([[piece] for piece in pieces])
    return blocks.rows(0, param.shape[0]) if param.split is Split.VOCAB else blocks


def piece_shape(param: MegatronParam, tp: int) -> tuple[int, ...]:
    """The shape of one tensor-parallel piece of ``param`` (for planning without data)."""
    shape = list(param.shape)
    if tp == 1 or param.split is Split.REPLICATED:
        return tuple(shape)
    if param.split is Split.VOCAB:
        shape[0] = _padded_rows(shape[0], tp) // tp
    else:
        shape[1 if param.split is Split.ROW else 0] //= tp
    return tuple(shape)
