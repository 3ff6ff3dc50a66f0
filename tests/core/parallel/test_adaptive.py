"""adaptive_cp_algo's rule: the algorithm chosen from the non-empty blocks of the C x C block mask."""

from __future__ import annotations

import pytest

from mindspeed.parallel.context_parallel import KVALLGATHER, RING, choose_cp_algo
from mindspeed.parallel.context_parallel.adaptive import LOCAL


@pytest.mark.parametrize(
    ("seq_len", "cp", "causal", "bounds", "window", "algo", "used"),
    [
        (32, 4, True, None, (-1, -1), RING, 3),  # causal: every ring step has a block
        (32, 4, False, None, (-1, -1), RING, 3),
        (32, 4, True, (0, 4, 8, 10, 12, 16, 20, 24, 28, 32), (-1, -1), LOCAL, 0),  # documents inside chunks
        (32, 4, True, (0, 2, 6, 8, 12, 16, 20, 24, 28, 32), (-1, -1), KVALLGATHER, 1),  # only step 1
        (64, 8, True, tuple(range(0, 65, 8)), (-1, -1), KVALLGATHER, 2),  # neighbours only: 2 of 7 steps
        (64, 8, True, (0, 40, 64), (-1, -1), RING, 7),
        (32, 4, True, None, (5, 0), KVALLGATHER, 3),  # a sliding window: only the all-gather takes it
    ],
)
def test_choice_by_counted_blocks(seq_len, cp, causal, bounds, window, algo, used) -> None:
    choice = choose_cp_algo(seq_len, cp, causal, bounds, window)
    assert (choice.algo, choice.used_steps) == (algo, used), choice.reason
    assert all(choice.visible[r][r] for r in range(cp))  # every rank attends its own shard (causal diagonal)


@pytest.mark.parametrize(
    ("causal", "bounds", "algo"),
    [
        (True, None, RING),  # ALiBi in the ring's blocks (it went to the all-gather before)
        (True, (0, 4, 8, 10, 12, 16, 20, 24, 28, 32), LOCAL),
        (True, (0, 2, 6, 8, 12, 16, 20, 24, 28, 32), KVALLGATHER),  # 1 of 3 steps, causal: the all-gather
        (False, (0, 2, 6, 8, 12, 16, 20, 24, 28, 32), RING),  # the all-gather takes ALiBi causal only
    ],
)
def test_alibi_follows_the_block_rule(causal, bounds, algo) -> None:
    assert choose_cp_algo(32, 4, causal, bounds, (-1, -1), True).algo == algo


def test_visibility_matches_brute_force() -> None:
    """visible[r][s] is exactly "some query of r sees some key of s" by the mask itself."""
    from mindspeed.parallel.context_parallel import shard_ranges

    seq_len, cp, bounds = 30, 3, (0, 2, 2, 19, 30)
    for causal in (True, False):
        for window in ((-1, -1), (3, 0)):
            if window != (-1, -1) and not causal:
                continue
            choice = choose_cp_algo(seq_len, cp, causal, bounds, window)

            def seg(p: int) -> int:
                return max(i for i, b in enumerate(bounds[:-1]) if b <= p and p < bounds[i + 1])

            for r in range(cp):
                for s in range(cp):
                    qs = [p for lo, hi in shard_ranges(seq_len, r, cp, "megatron_cp_algo") for p in range(lo, hi)]
                    ks = [p for lo, hi in shard_ranges(seq_len, s, cp, "megatron_cp_algo") for p in range(lo, hi)]
                    want = any(
                        seg(a) == seg(b) and (not causal or b <= a) and (window[0] < 0 or a - b <= window[0])
                        for a in qs
                        for b in ks
                    )
                    assert choice.visible[r][s] == want, (causal, window, r, s)
