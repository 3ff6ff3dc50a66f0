"""The CP layouts: MindSpeed's zig-zag and hybrid splits, uneven chunks, split/position helpers."""

from __future__ import annotations

import pytest
import torch

from mindspeed.parallel.context_parallel import (
    ALGOS,
    HYBRID,
    RING,
    ULYSSES,
    positions_for_context_parallel,
    shard_lengths,
    shard_ranges,
    split_for_context_parallel,
)


def _mindspeed_ring_split(val: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """MindSpeed/Megatron's get_batch_on_this_cp_rank: view as 2*CP chunks, take r and 2*CP-1-r."""
    val = val.view(*val.shape[:dim], 2 * size, val.shape[dim] // (2 * size), *val.shape[dim + 1 :])
    val = val.index_select(dim, torch.tensor([rank, 2 * size - rank - 1]))
    return val.view(*val.shape[:dim], -1, *val.shape[dim + 2 :])


def test_ring_layout_is_megatrons_zigzag() -> None:
    tokens = torch.arange(2 * 48).view(2, 48)
    for size in (1, 2, 3, 4):
        for rank in range(size):
            got = split_for_context_parallel(tokens, 1, rank, size, RING)
            assert torch.equal(got, _mindspeed_ring_split(tokens, 1, rank, size))


def test_hybrid_layout_is_ring_then_ulysses_chunks() -> None:
    hidden = torch.randn(48, 2, 5)  # megatron's [s, b, h]
    for size, degree in ((2, 2), (4, 2), (4, 1), (4, 4), (6, 3)):
        for rank in range(size):
            ring_rank, ulysses_rank = divmod(rank, degree)
            ring_shard = _mindspeed_ring_split(hidden, 0, ring_rank, size // degree)
            want = ring_shard.chunk(degree, dim=0)[ulysses_rank]
            got = split_for_context_parallel(hidden, 0, rank, size, HYBRID, ulysses_degree=degree)
            assert torch.equal(got, want)


def test_ulysses_layout_is_contiguous_chunks() -> None:
    tokens = torch.arange(24)
    for size in (1, 2, 3, 4):
        for rank in range(size):
            assert torch.equal(split_for_context_parallel(tokens, 0, rank, size, ULYSSES), tokens.chunk(size)[rank])


@pytest.mark.parametrize("algo", ALGOS)
def test_shards_partition_every_length(algo: str) -> None:
    for size, degree in ((1, 1), (2, 1), (2, 2), (3, 1), (4, 2), (4, 4)):
        for seq_len in range(0, 3 * 2 * size + 2):
            seen: list[int] = []
            for rank in range(size):
                positions = positions_for_context_parallel(seq_len, rank, size, algo, ulysses_degree=degree).tolist()
                assert positions == sorted(positions), "local order must rise (causal masks use it)"
                seen += positions
            assert sorted(seen) == list(range(seq_len))
            lengths = shard_lengths(seq_len, size, algo, degree)
            # Uneven lengths stay balanced: chunks differ by at most one token.
            assert max(lengths) - min(lengths) <= (1 if algo == ULYSSES else 2)


def test_unaligned_chunks_follow_tensor_split() -> None:
    # 13 tokens in 4 chunks: 4, 3, 3, 3; ring rank 0 holds chunks 0 and 3.
    chunks = torch.arange(13).tensor_split(4)
    got = split_for_context_parallel(torch.arange(13), 0, 0, 2, RING)
    assert torch.equal(got, torch.cat([chunks[0], chunks[3]]))
    assert shard_ranges(13, 1, 2, RING) == ((4, 7), (7, 10))


def test_split_matches_positions() -> None:
    data = torch.arange(3 * 29).view(3, 29) * 10
    for algo in ALGOS:
        for rank in range(4):
            positions = positions_for_context_parallel(29, rank, 4, algo, ulysses_degree=2)
            assert torch.equal(split_for_context_parallel(data, 1, rank, 4, algo, ulysses_degree=2), data[:, positions])


def test_bad_layout_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match="use one of"):
        shard_ranges(8, 0, 2, "ring_cp_algo")
    with pytest.raises(ValueError, match="ulysses_degree_in_cp"):
        shard_ranges(8, 0, 4, HYBRID, ulysses_degree=3)
    with pytest.raises(ValueError, match="outside the CP group"):
        shard_ranges(8, 2, 2, RING)


def test_packed_shard_ranges_split_every_sequence_zigzag() -> None:
    from mindspeed.parallel.context_parallel.layout import packed_shard_ranges, split_packed_for_context_parallel

    bounds = (0, 8, 12, 20)  # three sequences of 8, 4 and 8 tokens, CP 2: chunks of 2, 1, 2
    assert packed_shard_ranges(bounds, 0, 2) == ((0, 2), (6, 8), (8, 9), (11, 12), (12, 14), (18, 20))
    assert packed_shard_ranges(bounds, 1, 2) == ((2, 4), (4, 6), (9, 10), (10, 11), (14, 16), (16, 18))
    row = torch.arange(20).unsqueeze(0)
    shards = [split_packed_for_context_parallel(row, 1, bounds, r, 2) for r in range(2)]
    assert sorted(torch.cat(shards, dim=1).squeeze(0).tolist()) == list(range(20))
    with pytest.raises(ValueError, match="not a multiple of 2 \\* context_parallel_size = 4"):
        packed_shard_ranges((0, 6), 0, 2)
