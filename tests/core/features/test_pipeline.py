"""``noop_layers``: the indices become megatron's pipeline layout; bad indices are refused with the fix."""

from __future__ import annotations

import pytest

from mindspeed.features import FEATURES, BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features
from mindspeed.features.pipeline import noop_layer_layout, parse_noop_layers

E, T, L = "embedding", "decoder", "loss"


def test_indices_parse_from_a_string_or_a_list() -> None:
    assert parse_noop_layers("5, 0,5") == (0, 5)
    assert parse_noop_layers([3, 1]) == (1, 3)
    assert parse_noop_layers(None) == ()
    with pytest.raises(ValueError, match="not a list of layer indices"):
        parse_noop_layers("a,b")


def test_layout_keeps_the_real_layers_of_each_stage_in_megatron_order() -> None:
    # 6 layers over 2 stages, layers 0 and 1 noop: stage 0 keeps layer 2, stage 1 layers 3-5.
    assert noop_layer_layout((0, 1), 6, 2) == [[E, T], [T, T, T, L]]
    # PP2 x VPP2 over 8 layers: chunks [0,1] [2,3] [4,5] [6,7] go to (pp0,v0) (pp1,v0) (pp0,v1) (pp1,v1).
    assert noop_layer_layout((3, 7), 8, 2, 2) == [[E, T, T], [T], [T, T], [T, L]]
    assert noop_layer_layout((5,), 6, 1) == [[E, T, T, T, T, T, L]]


@pytest.mark.parametrize(
    ("noop", "num_layers", "stages", "message"),
    [
        ((6,), 6, 2, r"noop_layers \[6\] are not layers of num_layers=6"),
        ((0, 1), 2, 1, "leave no real layer"),
        ((0,), 5, 2, "num_layers=5 .noop layers included. is not divisible by the 2 pipeline stages"),
    ],
)
def test_bad_layouts_are_refused(noop: tuple, num_layers: int, stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        noop_layer_layout(noop, num_layers, stages)


def test_feature_is_on_with_noop_layers_and_sets_the_layout() -> None:
    feature = FEATURES.get("noop_layers")
    assert feature.level == 0 and feature.flags == ("--noop-layers",)
    facts = ModelFacts(extra={"num_layers": 4, "noop_layers": [0, 1]})
    ctx = BuildContext(parallel=ParallelSizes(pp=2, dp=1), model=facts)
    report = apply_features(FeaturesConfig(optimization_level=0), ctx)
    assert "noop_layers" in report.enabled
    assert ctx.config_overrides["pipeline_model_parallel_layout"] == [[E, T], [T, T, T, L]]
    plain = BuildContext(parallel=ParallelSizes(pp=2), model=ModelFacts(extra={"num_layers": 4}))
    assert "noop_layers" not in apply_features(FeaturesConfig(), plain).enabled
    bad = BuildContext(parallel=ParallelSizes(pp=4), model=facts)
    with pytest.raises(ValueError, match="feature 'noop_layers': num_layers=6 .* not divisible by the 4"):
        apply_features(FeaturesConfig(), bad)
