"""ModelShape's rotary_percent: megatron's ``--rotary-percent`` in a checkpoint's args and back,
the rotary width both megatron and transformers use, and a clear error for a bad value."""

from __future__ import annotations

import pytest

from mindspeed.model.shape import ModelShape

_SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, vocab_size=128)


def test_rotary_percent_travels_through_checkpoint_args() -> None:
    shape = ModelShape(**_SHAPE, kv_channels=24, rotary_percent=0.5)
    args = shape.to_args()
    assert args["rotary_percent"] == 0.5
    back = ModelShape.from_args(args)
    assert (back.rotary_percent, back.kv_channels, back.rotary_dim) == (0.5, 24, 12)
    assert shape.rotary_dim == 12
    # Checkpoints written before the field existed carry megatron's default.
    assert ModelShape.from_args({k: v for k, v in args.items() if k != "rotary_percent"}).rotary_percent == 1.0
    assert ModelShape(**_SHAPE).rotary_dim == 16


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_a_rotary_percent_outside_zero_one_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="rotary_percent must be in"):
        ModelShape(**_SHAPE, rotary_percent=value)
