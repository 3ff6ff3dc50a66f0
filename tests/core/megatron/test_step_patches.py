"""The per-step patches of megatron-core that skip work: they skip only what has nothing to do.

``reset-temporaries-moe-only``: megatron's walk over every module after a step runs when a
router has an expert bias or a global aux loss (str or list form), and only then.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mindspeed.megatron.patches import _reset_only_moe_tensors


@pytest.mark.parametrize(
    ("expert_bias", "balancing", "walks"),
    [
        (False, "aux_loss", False),
        (False, "none", False),
        (False, None, False),
        (True, "aux_loss", True),
        (False, "global_aux_loss", True),
        (False, ["aux_loss", "global_aux_loss"], True),
        (False, ["seq_aux_loss"], False),
    ],
)
def test_reset_walks_only_when_a_router_has_something_to_reset(
    expert_bias: bool, balancing: object, walks: bool
) -> None:
    calls = []
    reset = _reset_only_moe_tensors(lambda config, model: calls.append(model), None)
    config = SimpleNamespace(moe_router_enable_expert_bias=expert_bias, moe_router_load_balancing_type=balancing)
    reset(config, ["chunk"])
    assert calls == ([["chunk"]] if walks else [])
