"""The ring's block plan and KV all-gather's calls cover exactly the visible (query, key) pairs (brute force)."""

from __future__ import annotations

import bisect
import random

import torch

from mindspeed.ops.attention import visible_keys_mask
from mindspeed.parallel.context_parallel.blocks import Block, plan_blocks
from mindspeed.parallel.context_parallel.kv_allgather import plan_kv_allgather
from mindspeed.parallel.context_parallel.layout import zigzag_ranges
from mindspeed.parallel.context_parallel.ring import plan_ring


def _positions(ranges) -> list[int]:
    return [p for lo, hi in ranges for p in range(lo, hi)]


def _expected(q_pos: list[int], k_pos: list[int], causal: bool, bounds) -> torch.Tensor:
    """Visible pairs by definition: same packed sequence and, if causal, key not after query."""
    segment = (lambda p: bisect.bisect_right(bounds, p)) if bounds else (lambda p: 0)
    return torch.tensor(
        [[segment(a) == segment(b) and (not causal or b <= a) for b in k_pos] for a in q_pos], dtype=torch.int
    ).reshape(len(q_pos), len(k_pos))


def _covered(blocks: list[Block], q_len: int, k_len: int) -> torch.Tensor:
    """How many times each pair is attended, by the attention op's own mask of each block."""
    count = torch.zeros(q_len, k_len, dtype=torch.int)
    for blk in blocks:
        sq, sk = blk.q_stop - blk.q_start, blk.k_stop - blk.k_start
        cu = None if blk.cu_seqlens is None else torch.tensor(blk.cu_seqlens)
        mask = visible_keys_mask(sq, sk, causal=blk.causal, cu_seqlens=cu)
        count[blk.q_start : blk.q_stop, blk.k_start : blk.k_stop] += 1 if mask is None else mask.int()
    return count


def _random_bounds(rng: random.Random, seq_len: int):
    if rng.random() < 0.4:
        return None
    cuts = rng.sample(range(seq_len + 1), rng.randint(0, min(5, seq_len)))
    bounds = sorted({0, seq_len, *cuts})
    if len(bounds) > 2 and rng.random() < 0.3:
        bounds.insert(1, bounds[1])  # an empty sequence
    return tuple(bounds)


def test_blocks_cover_each_visible_pair_exactly_once() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        size, seq_len, causal = rng.choice([1, 2, 3, 4]), rng.randint(1, 33), rng.random() < 0.5
        bounds = _random_bounds(rng, seq_len)
        shards = [zigzag_ranges(seq_len, r, size) for r in range(size)]
        for r in range(size):
            for s in range(size):
                blocks = plan_blocks(shards[r], shards[s], seq_len=seq_len, causal=causal, bounds=bounds)
                q_pos, k_pos = _positions(shards[r]), _positions(shards[s])
                want = _expected(q_pos, k_pos, causal, bounds)
                got = _covered(blocks, len(q_pos), len(k_pos))
                assert torch.equal(got, want), (size, seq_len, causal, bounds, r, s)
                checked += 1
    assert checked > 1000


def test_contiguous_blocks_cover_each_pair_once_at_their_global_positions() -> None:
    """ALiBi's plans: the same coverage, and every block's rows and keys are consecutive positions
    starting at ``q_pos`` / ``k_pos`` (so ``alibi_offset`` puts them where they are)."""
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        size, seq_len, causal = rng.choice([1, 2, 3, 4]), rng.randint(1, 33), rng.random() < 0.5
        bounds = _random_bounds(rng, seq_len)
        shards = [zigzag_ranges(seq_len, r, size) for r in range(size)]
        for r in range(size):
            for s in range(size):
                kwargs = dict(seq_len=seq_len, causal=causal, bounds=bounds)
                blocks = plan_blocks(shards[r], shards[s], contiguous=True, **kwargs)
                q_pos, k_pos = _positions(shards[r]), _positions(shards[s])
                got = _covered(blocks, len(q_pos), len(k_pos))
                assert torch.equal(got, _expected(q_pos, k_pos, causal, bounds)), (size, seq_len, causal, bounds, r, s)
                for blk in blocks:
                    rows, keys = q_pos[blk.q_start : blk.q_stop], k_pos[blk.k_start : blk.k_stop]
                    assert rows == list(range(blk.q_pos, blk.q_pos + len(rows))), blk
                    assert keys == list(range(blk.k_pos, blk.k_pos + len(keys))), blk
                    # The op's query i sits at key index i + n_k - n_q + offset: key k_pos + that = q_pos + i.
                    assert blk.k_pos + len(keys) - len(rows) + blk.alibi_offset() == blk.q_pos, blk
                checked += 1
    assert checked > 700


def test_one_call_per_step_without_packing_or_with_a_causal_mask() -> None:
    """The merge recovers the classic zig-zag schedule; packed causal steps need one call too."""
    for size in (2, 3, 4):
        for seq_len in (4 * size, 4 * size + 3):
            for causal in (True, False):
                plan = plan_ring(seq_len, 1, size, causal, None)
                assert all(len(step) == 1 for step in plan.steps)
            plan = plan_ring(seq_len, 1, size, True, (0, 3, seq_len - 2, seq_len))
            assert all(len(step) <= 1 for step in plan.steps)
    # Zig-zag rank 0 of 2 (chunks 0 and 3 of 16 tokens): rank 1's keys (chunks 1, 2) are seen in
    # full by the second half of the queries only.
    plan = plan_ring(16, 0, 2, True, None)
    assert plan.steps[1] == (Block(4, 8, 0, 8),)
    plan = plan_ring(16, 1, 2, True, None)  # rank 0's first chunk is seen in full by all queries
    assert plan.steps[1] == (Block(0, 8, 0, 4),)


def test_kv_allgather_calls_cover_each_visible_pair_exactly_once() -> None:
    """KV all-gather's calls, by the op's bottom-right mask of each call, see exactly the visible pairs."""
    rng = random.Random(1)
    for _ in range(300):
        size, seq_len, causal = rng.choice([1, 2, 3, 4]), rng.randint(1, 33), rng.random() < 0.5
        left = rng.choice([-1, 0, 2, 5]) if causal else -1
        bounds = _random_bounds(rng, seq_len)
        for rank in range(size):
            shards, calls = plan_kv_allgather(seq_len, rank, size, causal, bounds, left=left)
            q_pos = _positions(shards[rank])
            want = _expected(q_pos, list(range(seq_len)), causal, bounds)
            if left >= 0:
                want &= (torch.arange(seq_len)[None, :] >= torch.tensor(q_pos, dtype=torch.long)[:, None] - left).int()
            got = torch.zeros(len(q_pos), seq_len, dtype=torch.int)
            for call in calls:
                sq, sk = call.q_stop - call.q_start, call.k_stop - call.k_start
                cu = None if call.cu_seqlens is None else torch.tensor(call.cu_seqlens)
                mask = visible_keys_mask(sq, sk, causal=causal, window_size=(left, -1), cu_seqlens=cu)
                got[call.q_start : call.q_stop, call.k_start : call.k_stop] += 1 if mask is None else mask.int()
            assert torch.equal(got, want), (size, seq_len, causal, left, bounds, rank)
            # Rows in local order, each once; at most two calls per zig-zag chunk under a causal mask.
            assert [c.q_start for c in calls] == sorted(c.q_start for c in calls)
            if causal:
                assert len(calls) <= 2 * len(shards[rank])
