"""Every context-parallel algorithm equals single-rank attention, on real gloo ranks.

Each group runs many configurations (one spawn per group: ranks cost seconds to start on a
2-core machine) and asserts once on the collected report: output rows and the shard's
``dq, dk, dv`` against ``attention_reference`` on the whole sequence, causal and full masks,
grouped-query attention (kv heads fewer than the Ulysses degree too), lengths that do not
divide by the CP degree, packed sequences whose boundaries fall inside and across shards,
ALiBi (the ring's and double ring's blocks biased by their global positions, causal and full),
fp32 and bf16.
"""

from __future__ import annotations

import pytest

from mindspeed.parallel.context_parallel import ADAPTIVE, HYBRID, KVALLGATHER, RING, ULYSSES
from mindspeed.testing.distributed import run_distributed
from tests.core.parallel.cp_cases import CpCase, case_dicts, check_cases

PACKED_22 = (0, 5, 6, 17, 22)  # shard edges at 11 (Ulysses, C=2) and 6/12/17 (ring chunks, C=2)
PACKED_30 = (0, 2, 2, 19, 30)  # an empty sequence and one spanning several zig-zag chunks

TWO_RANKS = [
    CpCase(ULYSSES, 16),
    CpCase(ULYSSES, 16, heads_kv=2, causal=False),
    CpCase(ULYSSES, 13, heads_kv=1),  # unaligned, one kv head for two ranks
    CpCase(ULYSSES, 22, heads_kv=2, cu_seqlens=PACKED_22),
    CpCase(ULYSSES, 22, causal=False, cu_seqlens=PACKED_22),
    CpCase(ULYSSES, 16, heads_kv=2, impl="auto"),
    CpCase(ULYSSES, 16, dtype="bfloat16"),
    CpCase(RING, 16),
    CpCase(RING, 16, causal=False),
    CpCase(RING, 16, heads_kv=1),
    CpCase(RING, 13, heads_kv=2),
    CpCase(RING, 13, causal=False),
    CpCase(RING, 22, cu_seqlens=PACKED_22),
    CpCase(RING, 30, heads_kv=2, cu_seqlens=PACKED_30),
    CpCase(RING, 30, causal=False, cu_seqlens=PACKED_30),
    CpCase(RING, 27, cu_seqlens=(0, 9, 20, 27)),  # packed and unaligned
    CpCase(RING, 16, overlap=False),
    CpCase(RING, 16, heads_kv=2, dtype="bfloat16"),
    # ALiBi in the ring: every block biased by its rows' and keys' global positions.
    CpCase(RING, 16, heads_kv=2, alibi=True),
    CpCase(RING, 13, heads_q=6, heads_kv=3, causal=False, alibi=True),  # unaligned, full mask, 6 heads
    CpCase(RING, 30, heads_kv=2, cu_seqlens=PACKED_30, alibi=True),
    CpCase(RING, 22, causal=False, cu_seqlens=PACKED_22, alibi=True),
    CpCase(RING, 16, heads_kv=2, dtype="bfloat16", alibi=True),
    CpCase(HYBRID, 16, heads_kv=2, ulysses_degree=2),  # 2 x 1: Ulysses only
    CpCase(HYBRID, 22, ulysses_degree=1, cu_seqlens=PACKED_22),  # 1 x 2: ring only
    CpCase(HYBRID, 13, ulysses_degree=2, causal=False),
    CpCase(KVALLGATHER, 16),
    CpCase(KVALLGATHER, 13, heads_kv=1),  # unaligned, MQA
    CpCase(KVALLGATHER, 16, heads_kv=2, causal=False),
    CpCase(KVALLGATHER, 16, heads_kv=2, window=3),  # window inside a chunk and across chunks
    CpCase(KVALLGATHER, 22, cu_seqlens=PACKED_22),
    CpCase(KVALLGATHER, 30, heads_kv=2, cu_seqlens=PACKED_30, window=4),
    CpCase(KVALLGATHER, 30, causal=False, cu_seqlens=PACKED_30),
    CpCase(KVALLGATHER, 16, heads_kv=2, alibi=True),
    CpCase(KVALLGATHER, 22, heads_q=6, heads_kv=2, cu_seqlens=PACKED_22, window=2, alibi=True),
    CpCase(KVALLGATHER, 16, heads_kv=2, dtype="bfloat16"),
    CpCase(ADAPTIVE, 16, heads_kv=2),  # -> ring
    CpCase(ADAPTIVE, 16, cu_seqlens=(0, 4, 9, 12, 16)),  # documents inside chunks -> local
    CpCase(ADAPTIVE, 22, causal=False, cu_seqlens=PACKED_22),  # every document inside one rank -> local
    CpCase(ADAPTIVE, 16, heads_kv=2, window=3),  # -> KV all-gather
    CpCase(ADAPTIVE, 16, heads_kv=2, alibi=True),  # -> ring
]

FOUR_RANKS = [
    CpCase(ULYSSES, 16, heads_kv=2),  # 2 kv heads for 4 ranks
    CpCase(ULYSSES, 19, heads_q=8, heads_kv=1, causal=False),
    CpCase(ULYSSES, 22, cu_seqlens=PACKED_22),
    CpCase(RING, 16),
    CpCase(RING, 13, heads_kv=2, causal=False),
    CpCase(RING, 30, cu_seqlens=PACKED_30),
    CpCase(RING, 30, causal=False, cu_seqlens=PACKED_30),
    CpCase(RING, 27, heads_kv=1, cu_seqlens=(0, 9, 20, 27)),
    CpCase(RING, 16, overlap=False),
    CpCase(RING, 16, heads_kv=2, alibi=True),
    CpCase(RING, 27, heads_kv=1, causal=False, cu_seqlens=(0, 9, 20, 27), alibi=True),
    CpCase(HYBRID, 16, heads_kv=1, ulysses_degree=2),  # 2 x 2, one kv head
    CpCase(HYBRID, 13, heads_kv=2, ulysses_degree=2, causal=False),
    CpCase(HYBRID, 22, ulysses_degree=2, cu_seqlens=PACKED_22),
    CpCase(HYBRID, 23, ulysses_degree=2, causal=False, cu_seqlens=(0, 4, 15, 23)),
    CpCase(HYBRID, 16, ulysses_degree=4),  # 4 x 1
    CpCase(HYBRID, 16, heads_kv=2, ulysses_degree=1),  # 1 x 4
    CpCase(KVALLGATHER, 16, heads_kv=2, window=5),
    CpCase(KVALLGATHER, 27, heads_kv=1, cu_seqlens=(0, 9, 20, 27)),
    CpCase(KVALLGATHER, 30, causal=False, cu_seqlens=PACKED_30),
    # The double ring: 2 windows of 2 ranks.
    CpCase(RING, 16, cp_window=2),
    CpCase(RING, 13, heads_kv=2, causal=False, cp_window=2),
    CpCase(RING, 30, cu_seqlens=PACKED_30, cp_window=2),
    CpCase(RING, 30, causal=False, cu_seqlens=PACKED_30, cp_window=2),
    CpCase(RING, 27, heads_kv=1, cu_seqlens=(0, 9, 20, 27), cp_window=2),
    CpCase(RING, 16, overlap=False, cp_window=2),
    CpCase(RING, 16, heads_kv=2, dtype="bfloat16", cp_window=2),
    CpCase(RING, 16, heads_kv=2, alibi=True, cp_window=2),
    CpCase(RING, 30, causal=False, cu_seqlens=PACKED_30, alibi=True, cp_window=2),
    # Adaptive on each mask kind (the chosen algorithm is in the report's case name).
    CpCase(ADAPTIVE, 32, heads_kv=2),  # causal -> ring
    CpCase(ADAPTIVE, 32, cu_seqlens=(0, 4, 8, 10, 12, 16, 20, 24, 28, 32)),  # inside chunks -> local
    CpCase(ADAPTIVE, 32, cu_seqlens=(0, 2, 6, 8, 12, 16, 20, 24, 28, 32)),  # 1 of 3 steps -> KV all-gather
    CpCase(ADAPTIVE, 30, cu_seqlens=PACKED_30, cp_window=2),  # -> double ring
    CpCase(ADAPTIVE, 16, heads_kv=2, window=5),  # -> KV all-gather
    CpCase(ADAPTIVE, 16, causal=False),  # -> ring
    CpCase(ADAPTIVE, 32, heads_kv=2, alibi=True),  # causal -> ring, ALiBi in every block
    CpCase(ADAPTIVE, 32, cu_seqlens=(0, 4, 8, 10, 12, 16, 20, 24, 28, 32), alibi=True),  # -> local
    CpCase(ADAPTIVE, 32, causal=False, cu_seqlens=(0, 2, 6, 8, 12, 16, 20, 24, 28, 32), alibi=True),  # -> ring
]


def _assert_all_equal_reference(results: list[list[dict]]) -> None:
    lines, failed = [], []
    for rank, reports in enumerate(results):
        for report in reports:
            diffs = " ".join(f"{k}={d['max_abs']:.1e}{'' if d['ok'] else '(FAIL)'}" for k, d in report["diffs"].items())
            lines.append(f"rank {rank} | {report['case']} | {diffs}")
            if not report["ok"]:
                failed.append(lines[-1])
    summary = "\n".join(failed) + "\n\nall:\n" + "\n".join(lines)
    assert not failed, "CP results differ from single-rank attention:\n" + summary


@pytest.mark.distributed
def test_every_algorithm_equals_single_rank_attention_on_two_ranks() -> None:
    _assert_all_equal_reference(run_distributed(check_cases, 2, case_dicts(TWO_RANKS), timeout=300))


@pytest.mark.distributed
@pytest.mark.slow
def test_every_algorithm_equals_single_rank_attention_on_four_ranks() -> None:
    _assert_all_equal_reference(run_distributed(check_cases, 4, case_dicts(FOUR_RANKS), False, timeout=400))
