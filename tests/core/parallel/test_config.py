"""ContextParallelConfig: MindSpeed's names, degrees and the checks that name the fix."""

from __future__ import annotations

import pytest

from mindspeed.config import ConfigError, from_dict
from mindspeed.parallel.context_parallel import ContextParallelConfig
from mindspeed.parallel.context_parallel.ulysses import expand_kv_heads


def test_degrees_per_algorithm() -> None:
    assert ContextParallelConfig().context_parallel_algo == "megatron_cp_algo"
    ring = ContextParallelConfig(8, "megatron_cp_algo")
    assert (ring.ulysses_degree, ring.ring_degree) == (1, 8)
    ulysses = ContextParallelConfig(8, "ulysses_cp_algo")
    assert (ulysses.ulysses_degree, ulysses.ring_degree) == (8, 1)
    hybrid = ContextParallelConfig(8, "hybrid_cp_algo", ulysses_degree_in_cp=2)
    assert (hybrid.ulysses_degree, hybrid.ring_degree) == (2, 4)


def test_from_a_recipe_with_mindspeed_keys() -> None:
    config = from_dict(
        ContextParallelConfig,
        {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 2},
    )
    assert config.ring_degree == 2
    with pytest.raises(ConfigError, match="not one of"):
        from_dict(ContextParallelConfig, {"context_parallel_algo": "ring"})


def test_invalid_configs_name_the_fix() -> None:
    with pytest.raises(ValueError, match="needs ulysses_degree_in_cp"):
        ContextParallelConfig(4, "hybrid_cp_algo")
    with pytest.raises(ValueError, match="to divide"):
        ContextParallelConfig(4, "hybrid_cp_algo", ulysses_degree_in_cp=3)
    with pytest.raises(ValueError, match="divisible by the Ulysses degree"):
        ContextParallelConfig(8, "ulysses_cp_algo").check_heads(num_heads=12, num_kv_heads=4)
    with pytest.raises(ValueError, match="must divide context_parallel_size=6 and be below it"):
        ContextParallelConfig(6, "megatron_cp_algo", cp_window_size=4)
    with pytest.raises(ValueError, match="must divide context_parallel_size=4 and be below it"):
        ContextParallelConfig(4, "megatron_cp_algo", cp_window_size=4)
    with pytest.raises(ValueError, match="needs megatron_cp_algo, not ulysses_cp_algo"):
        ContextParallelConfig(4, "ulysses_cp_algo", cp_window_size=2)
    assert ContextParallelConfig(8, "megatron_cp_algo", cp_window_size=2).cp_window_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ContextParallelConfig(2, "ulysses_cp_algo").check_heads(num_heads=6, num_kv_heads=3, tensor_parallel_size=2)
    ContextParallelConfig(4, "ulysses_cp_algo").check_heads(num_heads=8, num_kv_heads=1)  # GQA: kv < U is fine
    ContextParallelConfig(4, "megatron_cp_algo").check_heads(num_heads=6, num_kv_heads=3)  # ring: no constraint


def test_kv_head_expansion_keeps_grouped_query_pairing() -> None:
    """After expansion, Ulysses rank j's q heads still use their own kv head."""
    import torch

    heads_q, degree = 8, 4
    for heads_kv in (1, 2, 4, 8):
        k = torch.arange(heads_kv).float().view(1, 1, heads_kv, 1)
        expanded, _ = expand_kv_heads(k, k, degree)
        assert expanded.shape[2] % degree == 0
        per_rank_q, per_rank_kv = heads_q // degree, expanded.shape[2] // degree
        for rank in range(degree):
            for h in range(rank * per_rank_q, (rank + 1) * per_rank_q):
                local_kv = (h - rank * per_rank_q) // (per_rank_q // per_rank_kv)
                assert expanded[0, 0, rank * per_rank_kv + local_kv, 0] == h // (heads_q // heads_kv)
