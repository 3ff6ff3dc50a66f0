"""The context_parallel feature: MindSpeed's double-ring window and adaptive CP become config attributes."""

from __future__ import annotations

import pytest

from mindspeed.features import BuildContext, FeaturesConfig, ParallelSizes, apply_features


def _overrides(cp: int, **settings) -> dict:
    ctx = BuildContext(parallel=ParallelSizes(cp=cp))
    apply_features(FeaturesConfig(settings={"context_parallel": {"enabled": True, **settings}}), ctx)
    keys = ("context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes", "cp_window_size")
    return {k: v for k, v in ctx.config_overrides.items() if k in (*keys, "cp_adaptive")}


def test_double_ring_and_adaptive_settings() -> None:
    assert _overrides(4, cp_window_size=2) == {"context_parallel_size": 4, "cp_comm_type": "p2p", "cp_window_size": 2}
    plain = _overrides(4)
    assert "cp_window_size" not in plain and "cp_adaptive" not in plain  # only when used
    assert _overrides(4, context_parallel_algo="adaptive_cp_algo", cp_window_size=2) == {
        "context_parallel_size": 4,
        "cp_comm_type": "p2p",  # adaptive runs on the ring's zig-zag layout
        "cp_window_size": 2,
        "cp_adaptive": True,
    }


@pytest.mark.parametrize(
    ("cp", "settings", "message"),
    [
        (6, {"cp_window_size": 4}, "cp_window_size=4 must divide context_parallel_size=6 and be below it"),
        (4, {"cp_window_size": 4}, "must divide context_parallel_size=4 and be below it"),
        (4, {"cp_window_size": 2, "context_parallel_algo": "ulysses_cp_algo"}, "needs megatron_cp_algo"),
    ],
)
def test_bad_windows_are_one_line_errors(cp: int, settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        _overrides(cp, **settings)
    assert "\n" not in str(error.value)


def test_transformer_config_carries_the_attributes() -> None:
    from mindspeed.megatron.config import transformer_config
    from mindspeed.model.shape import ModelShape
    from mindspeed.testing.megatron import ParallelSizes as Layout

    shape = ModelShape(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=32)
    config = transformer_config(shape, Layout(), cp_window_size=2, cp_adaptive=True)
    assert (config.cp_window_size, config.cp_adaptive) == (2, True)
