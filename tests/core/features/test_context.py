"""The BuildContext: read-only facts, recorded mutations only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.nn.functional as F

from mindspeed.features import BuildContext, ModelFacts, ParallelSizes


def test_mutations_go_through_recording_methods() -> None:
    ctx = BuildContext(accelerator="cpu")
    assert ctx.kernel_for("rms_norm") == "reference"
    with pytest.raises(TypeError):
        ctx.kernel_impls["rms_norm"] = "native"  # a read-only view
    with pytest.raises(TypeError):
        ctx.config_overrides["x"] = 1
    with ctx.applying("demo"):
        first = ctx.set_kernel("rms_norm", "native", reason="r")
        second = ctx.set_kernel("rms_norm", "compile")
    user = ctx.set_config("offload", True)
    assert ctx.kernel_for("rms_norm") == "compile"
    assert (first.feature, first.before, first.after) == ("demo", "reference", "native")
    assert (second.before, second.after) == ("native", "compile")
    assert user.feature == "user"
    assert ctx.changes == (first, second, user)
    assert not hasattr(ctx, "set_optimizer")  # the seam without a reader is gone


def test_kernel_choices_are_a_value() -> None:
    from mindspeed.features import KernelChoices

    ctx = BuildContext(accelerator="cpu")
    ctx.set_kernel("rms_norm", "native")
    choices = ctx.kernel_choices()
    ctx.set_kernel("swiglu", "native")  # later changes do not reach a value already handed out
    assert dict(choices) == {"rms_norm": "native"}
    assert (choices.kernel_for("rms_norm"), choices.kernel_for("swiglu")) == ("native", "reference")
    plain = KernelChoices.of({"attention": "sdpa"})  # a mapping: "auto" for the ops it does not name
    assert (plain.kernel_for("attention"), plain.kernel_for("rms_norm")) == ("sdpa", "auto")
    assert KernelChoices.of(choices) is choices and KernelChoices() == KernelChoices({}, "auto")


def test_hooks_and_facts() -> None:
    ctx = BuildContext(accelerator="cpu", parallel=ParallelSizes(cp=2))
    change = ctx.add_hook("pre_step", len)
    assert ctx.hooks["pre_step"] == (len,) and change.after == ["builtins.len"]
    with pytest.raises(ValueError, match="unknown hook point 'pre_stepp'"):
        ctx.add_hook("pre_stepp", len)
    with pytest.raises(ValueError, match="tp=0"):
        ParallelSizes(tp=0)
    with pytest.raises(AttributeError):
        ctx.parallel.cp = 4  # frozen
    assert ctx.facts()["parallel"]["cp"] == 2


def test_model_facts_from_a_transformer_config() -> None:
    swiglu_moe = SimpleNamespace(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        num_moe_experts=8,
        moe_token_dispatcher_type="alltoall",
    )
    facts = ModelFacts.from_transformer_config(swiglu_moe, position_embedding_type="rope")
    assert (facts.normalization, facts.swiglu, facts.is_moe, facts.moe_token_dispatcher_type) == (
        "RMSNorm",
        True,
        True,
        "alltoall",
    )
    dense_gelu = SimpleNamespace(
        normalization="LayerNorm",
        gated_linear_unit=False,
        activation_func=F.gelu,
        num_moe_experts=None,
        moe_token_dispatcher_type="allgather",
    )
    facts = ModelFacts.from_transformer_config(dense_gelu)
    assert (facts.swiglu, facts.is_moe, facts.position_embedding_type) == (False, False, None)
    assert ModelFacts().is_moe is None
