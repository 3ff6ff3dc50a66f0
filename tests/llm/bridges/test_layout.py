"""Tensor-parallel pieces equal megatron-core's own partitioning; placements cover every rank once;
bad layouts fail naming the flag."""

from __future__ import annotations

import pytest
import torch

from mindspeed_llm.bridges import (
    MegatronParam,
    ModelShape,
    ParallelLayout,
    Split,
    megatron_params,
    merge_tensors,
    split_tensor,
)
from mindspeed_llm.bridges.layout import piece_shape

SHAPE = ModelShape(
    num_layers=8,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=8,
    vocab_size=50,
    untie_embeddings_and_output_weights=False,
)
MOE = ModelShape(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=8,
    vocab_size=64,
    num_experts=4,
    moe_ffn_hidden_size=16,
    moe_layer_freq=(0, 1, 1, 1),
)


def _megatron_pieces(full: torch.Tensor, dim: int, stride: int, tp: int, rows: int | None = None) -> list[torch.Tensor]:
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    out_size = rows or full.shape[0]
    padded = torch.zeros(out_size, full.shape[1])
    padded[: full.shape[0]] = full
    pieces = []
    for rank in range(tp):
        local_shape = [out_size, full.shape[1]]
        local_shape[dim] //= tp
        weight = torch.nn.Parameter(torch.empty(local_shape))
        _initialize_affine_weight_cpu(
            weight,
            out_size,
            full.shape[1],
            local_shape[dim],
            dim,
            lambda master: master.copy_(padded),
            stride=stride,
            rank=rank,
            world_size=tp,
            skip_set_tensor_parallel_attributes=True,
        )
        pieces.append(weight.data)
    return pieces


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "split,dim,stride", [(Split.COLUMN, 0, 1), (Split.ROW, 1, 1), (Split.GLU, 0, 2), (Split.VOCAB, 0, 1)]
)
def test_split_matches_megatron_and_merges_back(split: Split, dim: int, stride: int, tp: int) -> None:
    rows = 50 if split is Split.VOCAB else 48
    full = torch.randn(rows, 16)
    param = MegatronParam("p", tuple(full.shape), split)
    ours = split_tensor(param, full, tp)
    padded_rows = -(-rows // tp) * tp if split is Split.VOCAB else None
    for mine, theirs in zip(ours, _megatron_pieces(full, dim, stride, tp, padded_rows)):
        assert torch.equal(mine, theirs)
        assert tuple(mine.shape) == piece_shape(param, tp)
    assert torch.equal(merge_tensors(param, ours), full)


@pytest.mark.parametrize("tp", [1, 2])
def test_sections_give_each_rank_its_block_of_every_section(tp: int) -> None:
    """The Gated DeltaNet's in_proj ``[q | k | v | z | b | a]``: megatron's rank r computes its own
    heads of every section (``torch.split`` of its local rows by section / tp), views included."""
    from mindspeed.checkpointing.blocks import Blocks
    from mindspeed_llm.bridges.layout import merge_blocks, split_blocks

    sections = (8, 8, 12, 12, 4, 4)
    full = torch.randn(sum(sections), 6)
    param = MegatronParam("in_proj.weight", tuple(full.shape), Split.SECTIONS, sections=sections)
    pieces = split_tensor(param, full, tp)
    for rank, piece in enumerate(pieces):
        local = piece.split([size // tp for size in sections])
        for part, whole in zip(local, full.split(list(sections))):
            assert torch.equal(part, whole.chunk(tp)[rank])
        assert tuple(piece.shape) == piece_shape(param, tp)
    assert torch.equal(merge_tensors(param, pieces), full)
    views = split_blocks(param, Blocks.of(full), tp)
    assert all(torch.equal(view.tensor(), piece) for view, piece in zip(views, pieces))
    assert torch.equal(merge_blocks(param, pieces).tensor(), full)
    with pytest.raises(ValueError, match="sections"):
        split_tensor(param, full, 8)


def test_replicated_pieces_must_agree() -> None:
    param = MegatronParam("decoder.final_layernorm.weight", (4,), Split.REPLICATED)
    with pytest.raises(ValueError, match="rank 1 holds a different copy"):
        merge_tensors(param, [torch.ones(4), torch.zeros(4)])


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(tp=2, pp=2),
        ParallelLayout(pp=4, vpp_layers=1),
        ParallelLayout(pp=2, vpp_layers=2),
        ParallelLayout(pp=3, num_layer_list=(2, 5, 1)),
        ParallelLayout(tp=2, pp=2, ep=2),
    ],
)
def test_every_piece_lands_once(layout: ParallelLayout) -> None:
    shape = MOE if layout.ep > 1 else SHAPE
    layout.check(shape)
    seen: dict[tuple, str] = {}
    layers_per_chunk: dict[tuple, set[int]] = {}
    for param in megatron_params(shape).values():
        for piece in layout.place(param, shape):
            key = (piece.rank, piece.chunk, piece.name)
            assert key not in seen, f"{param.name} and {seen[key]} collide at {key}"
            seen[key] = param.name
            if param.layer is not None:
                layers_per_chunk.setdefault((piece.rank.pp, piece.chunk), set()).add(param.layer)
    # Global layer order: chunk i of stage p holds global chunk i * pp + p (megatron's offset rule).
    ordered = [sorted(layers_per_chunk[(p, c)]) for c in range(layout.num_chunks(shape)) for p in range(layout.pp)]
    assert [layer for chunk in ordered for layer in chunk] == list(range(shape.num_layers))
    if layout.num_layer_list:
        assert [len(layers) for layers in ordered] == list(layout.num_layer_list)
    # Every rank of the layout holds something; the tied embedding has a copy on the last stage.
    assert {key[0] for key in seen} == set(layout.ranks())
    if layout.pp > 1 and shape.tie_embeddings:
        last = layout.last_stage(shape)
        assert any(k[0].pp == last[0] and k[1] == last[1] and k[2] == "output_layer.weight" for k in seen)


def test_experts_are_renumbered_per_expert_rank() -> None:
    layout = ParallelLayout(ep=2)
    param = megatron_params(MOE)["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    (piece,) = layout.place(param, MOE)
    assert piece.rank.ep == 1 and piece.name == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"


@pytest.mark.parametrize(
    "layout,message",
    [
        (ParallelLayout(tp=4), r"--target-tensor-parallel-size 4 does not divide num_key_value_heads 2"),
        (ParallelLayout(tp=3), r"--target-tensor-parallel-size 3 does not divide num_attention_heads 4"),
        (
            ParallelLayout(pp=3),
            r"--target-pipeline-parallel-size 3 does not divide the 8 layers; pass --num-layer-list",
        ),
        (
            ParallelLayout(pp=2, num_layer_list=(3, 4)),
            r"--num-layer-list 3,4 must give 2 positive layer counts .* summing to 8",
        ),
        (ParallelLayout(pp=2, vpp_layers=3), r"--num-layers-per-virtual-pipeline-stage 3 times"),
        (ParallelLayout(pp=2, vpp_layers=1, num_layer_list=(4, 4)), r"exclude each other"),
        (ParallelLayout(ep=2), r"--target-expert-parallel-size 2 needs a mixture-of-experts model"),
    ],
)
def test_bad_layouts_name_the_flag(layout: ParallelLayout, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout.check(SHAPE)


@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_layout_is_the_v(pp: int) -> None:
    """DualPipeV's V: rank r holds layer chunks r and 2P-1-r, rank 0 the embedding and (chunk 1) the head."""
    from mindspeed.megatron.dualpipev import dualpipev_chunks

    layout = ParallelLayout(tp=2, pp=pp, dualpipev=True)
    held: dict[tuple[int, int], set[int]] = {}
    seen: set[tuple] = set()
    for param in megatron_params(SHAPE).values():
        for piece in layout.place(param, SHAPE):
            key = (piece.rank, piece.chunk, piece.name)
            assert key not in seen, key
            seen.add(key)
            if param.layer is not None:
                held.setdefault((piece.rank.pp, piece.chunk), set()).add(param.layer)
            elif param.name.startswith("embedding."):
                assert (piece.rank.pp, piece.chunk) in ((0, 0), (0, 1))  # the tied copy on rank 0's chunk 1
            else:
                assert (piece.rank.pp, piece.chunk) == (0, 1), param.name
    for rank, chunks in enumerate(dualpipev_chunks(SHAPE.num_layers, pp)):
        assert [sorted(held[(rank, c)]) for c in (0, 1)] == [list(r) for r in chunks]
    assert layout.num_chunks(SHAPE) == 2 and layout.last_stage(SHAPE) == (0, 1)
    assert any(k[0].pp == 0 and k[1] == 1 and k[2] == "output_layer.weight" for k in seen)
