"""The kernel features select what mindspeed.ops.resolve_kernel picks, and check the model facts."""

from __future__ import annotations

import pytest

from mindspeed.features import FEATURES, BuildContext, FeaturesConfig, ModelFacts, apply_features
from mindspeed.features.kernels import KERNEL_FEATURES
from mindspeed.ops import OPS, available_kernels, resolve_kernel

LLAMA_MOE = ModelFacts(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    num_moe_experts=4,
    moe_token_dispatcher_type="alltoall",
)
ALL_ON = {cls.name: True for cls in KERNEL_FEATURES}


def apply(settings: dict, facts: ModelFacts = LLAMA_MOE, level: int = 2) -> tuple[BuildContext, object]:
    ctx = BuildContext(accelerator="cpu", model=facts)
    return ctx, apply_features(FeaturesConfig(optimization_level=level, settings=settings), ctx)


def test_every_kernel_feature_is_registered_level_1_with_flags_and_real_ops() -> None:
    for cls in KERNEL_FEATURES:
        feature = FEATURES.get(cls.name)
        assert feature.level == 1 and feature.flags and feature.description
        assert feature.targets[: len(feature.ops)] == tuple(f"kernel_impls.{op}" for op in feature.ops)
        assert all(op in OPS for op in feature.ops)


def test_kernel_impls_match_resolve_kernel() -> None:
    ctx, report = apply(ALL_ON)
    expected = {op: resolve_kernel(op, "auto", device="cpu").name for cls in KERNEL_FEATURES for op in cls.ops}
    assert dict(ctx.kernel_impls) == expected
    # Gradient-accumulation fusion also turns megatron's flag on: its linear layers then call the kernel.
    assert dict(ctx.config_overrides) == {"gradient_accumulation_fusion": True}
    assert len(report.changes) == len(expected) + 1
    ctx, _ = apply({name: {"impl": "reference"} for name in ALL_ON})
    assert set(ctx.kernel_impls.values()) == {"reference"}
    ctx, report = apply({"fused_rmsnorm": {"enabled": True, "impl": "native"}, "flash_attn": {"impl": "sdpa"}}, level=0)
    assert dict(ctx.kernel_impls) == {"rms_norm": "native"}  # an impl alone does not turn a feature on...
    assert "ignored" in report.status("flash_attn").why  # ...and the report says so


def test_defaults_follow_available_kernels_and_levels() -> None:
    ctx, report = apply({})
    for cls in KERNEL_FEATURES:
        faster = all(available_kernels(op, "cpu")[0].name != "reference" for op in cls.ops)
        assert report.status(cls.name).enabled is faster
    ctx, report = apply({}, level=0)
    assert report.order == [] and dict(ctx.kernel_impls) == {}
    assert ctx.kernel_for("rms_norm") == "reference"  # off means the reference
    ctx, _ = apply({"fused_rmsnorm": False})
    assert "rms_norm" not in ctx.kernel_impls


def test_attention_features_reach_the_resolver() -> None:
    facts = ModelFacts(attention_features=("lse",))
    ctx, _ = apply({"flash_attn": True}, facts)
    assert ctx.kernel_impls["attention"] == resolve_kernel("attention", device="cpu", features=("lse",)).name


@pytest.mark.parametrize(
    ("name", "facts", "words"),
    [
        ("fused_rmsnorm", ModelFacts(normalization="LayerNorm"), "normalization is 'LayerNorm'"),
        ("fused_swiglu", ModelFacts(swiglu=False), "not a SwiGLU"),
        ("fused_rotary_pos_emb", ModelFacts(position_embedding_type="learned_absolute"), "'learned_absolute'"),
        ("moe_grouped_gemm", ModelFacts(num_moe_experts=0), "no routed experts"),
        ("moe_permute_fusion", ModelFacts(num_moe_experts=8, moe_token_dispatcher_type="allgather"), "'allgather'"),
    ],
)
def test_model_facts_rule_features_out(name: str, facts: ModelFacts, words: str) -> None:
    with pytest.raises(ValueError) as err:
        apply({name: True}, facts)
    assert str(err.value).startswith(f"feature {name!r}: ") and words in str(err.value)
    assert f"settings.{name}.enabled=false" in str(err.value)
    _, report = apply({}, facts)  # by default it just stays off, saying why
    assert report.status(name).enabled is False and words in report.status(name).why


def test_bad_impl_names_the_feature_and_the_choices() -> None:
    with pytest.raises(ValueError, match="feature 'flash_attn': settings.flash_attn.impl='fa3'.*known: .*sdpa"):
        apply({"flash_attn": {"impl": "fa3"}})
    with pytest.raises(ValueError, match="feature 'fused_rmsnorm': .*'npu'.* not on cpu"):
        apply({"fused_rmsnorm": {"impl": "npu"}})
