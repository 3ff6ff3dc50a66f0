"""The ``alibi`` feature: on exactly for ALiBi models, with an attention kernel that takes the slopes."""

from __future__ import annotations

import pytest

from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features
from mindspeed.ops import KERNELS


def test_on_only_for_alibi_models_and_keeps_an_alibi_kernel() -> None:
    report = apply_features(FeaturesConfig(optimization_level=0), BuildContext("cpu", model=ModelFacts()))
    assert "alibi" not in report.enabled, "a run without ALiBi must not list it"
    alibi = ModelFacts(position_embedding_type="alibi", attention_features=("alibi",))
    ctx = BuildContext("cpu", model=alibi)
    report = apply_features(FeaturesConfig(optimization_level=1), ctx)
    assert "alibi" in report.enabled and [c.target for c in report.changes_of("alibi")] == ["kernel_impls.attention"]
    assert KERNELS.get(("attention", ctx.kernel_for("attention"))).supports(("alibi",))
    # On an NPU the fused kernel has no ALiBi yet: the attention kernel falls back to one with it.
    ctx = BuildContext("npu", model=ModelFacts(position_embedding_type="alibi"))
    ctx.set_kernel("attention", "npu")
    apply_features(FeaturesConfig(optimization_level=0), ctx)
    assert ctx.kernel_for("attention") == "sdpa"


@pytest.mark.parametrize(
    ("facts", "parallel", "message"),
    [
        (ModelFacts(position_embedding_type="rope"), ParallelSizes(), "position_embedding_type is 'rope'"),
        (
            ModelFacts(position_embedding_type="alibi", extra={"num_attention_heads": 6}),
            ParallelSizes(tp=4),
            "6 attention heads do not split over tp=4",
        ),
    ],
)
def test_refused_with_one_line(facts: ModelFacts, parallel: ParallelSizes, message: str) -> None:
    settings = {"alibi": {"enabled": True}, "context_parallel": {"enabled": False}}
    with pytest.raises(ValueError, match=message):
        apply_features(FeaturesConfig(optimization_level=0, settings=settings), BuildContext("cpu", parallel, facts))
