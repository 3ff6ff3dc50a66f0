"""Views in place of copies: every Blocks operation of the bridges equals its materialising
counterpart (split_tensor, merge_tensors, the rules' to_megatron / to_hf). Blocks and write_blocks
themselves: tests/core/checkpointing/test_block_io.py."""

from __future__ import annotations

import pytest
import torch

from mindspeed.checkpointing.blocks import Blocks
from mindspeed_llm.bridges import MegatronParam, ModelShape, Split, merge_tensors, split_tensor
from mindspeed_llm.bridges.layout import merge_blocks, split_blocks
from mindspeed_llm.bridges.rules import FuseGateUp, FuseQKV, Rename

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=16,
    ffn_hidden_size=24,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=4,
    vocab_size=50,
)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("split", list(Split))
def test_split_and_merge_as_views_equal_the_copies(split: Split, tp: int) -> None:
    rows = 50 if split is Split.VOCAB else 48
    full = torch.randn(rows, 16)
    param = MegatronParam("p", tuple(full.shape), split)
    want = split_tensor(param, full, tp)
    # Through blocks made of several views (as a fused source hands them over).
    for blocks in (Blocks.of(full), Blocks([[full[:7]], [full[7:30]], [full[30:]]])):
        got = split_blocks(param, blocks, tp)
        assert len(got) == tp
        for mine, theirs in zip(got, want):
            assert mine.shape == tuple(theirs.shape) and torch.equal(mine.tensor(), theirs)
    merged = merge_blocks(param, [piece.contiguous() for piece in want])
    assert merged.shape == tuple(full.shape) and torch.equal(merged.tensor(), merge_tensors(param, want))


@pytest.mark.parametrize("bias", [False, True])
def test_rules_as_views_equal_the_copies(bias: bool) -> None:
    width = () if bias else (16,)
    q, k, v = torch.randn(16, *width), torch.randn(8, *width), torch.randn(8, *width)
    gate, up = torch.randn(24, *width), torch.randn(24, *width)
    for rule, inputs in (
        (FuseQKV("m", "q", "k", "v"), [q, k, v]),
        (FuseGateUp("m", "g", "u"), [gate, up]),
        (Rename("m", "h"), [q]),
    ):
        fused = rule.to_megatron(inputs, SHAPE)
        assert torch.equal(rule.to_megatron_blocks(inputs, SHAPE).tensor(), fused)
        # Back, from a fused tensor given as tensor-parallel pieces (views of each piece).
        pieces = list(fused.chunk(2))
        for mine, theirs in zip(rule.to_hf_blocks(Blocks([[p] for p in pieces]), SHAPE), rule.to_hf(fused, SHAPE)):
            assert torch.equal(mine.tensor(), theirs)
