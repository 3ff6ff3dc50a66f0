"""The memory features refuse settings that cannot work, naming the fix, before anything changes."""

from __future__ import annotations

import pytest

from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features


def _apply(settings: dict, **extra: object) -> BuildContext:
    context = BuildContext("cpu", model=ModelFacts(extra=extra))
    apply_features(FeaturesConfig(optimization_level=0, settings=settings), context)
    return context


@pytest.mark.parametrize(
    ("settings", "extra", "message"),
    [
        ({"reuse_fp32_param": True}, {"precision": "fp32"}, "train.precision=bf16"),
        ({"swap_optimizer": True}, {"distributed_optimizer": False}, "parallel.distributed_optimizer=true"),
        ({"swap_optimizer": {"enabled": True, "swap_optimizer_times": 0}}, {}, "use 1 or more chunks"),
        ({"recompute_norm": {"enabled": True, "num_layers": 0}}, {}, "recomputes nothing"),
        (
            {"recompute_activation_function": {"enabled": True, "num_layers": 9}},
            {"num_layers": 8},
            "more than the model's 8 layers",
        ),
        (
            {"recompute_activation_function": True},
            {"recompute_granularity": "full", "recompute_method": "uniform"},
            "use model.recompute_method: block",
        ),
        ({"recompute_norm": True}, {"recompute_granularity": "full", "recompute_method": None}, "every layer"),
        ({"swap_attention": {"enabled": True, "swap_modules": ["mlp"]}}, {}, "unknown modules ['mlp']"),
        ({"swap_optimizer": True, "reuse_fp32_param": True}, {}, "conflict"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(settings: dict, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _apply(settings, **extra)


def test_good_settings_attach_one_hook_each() -> None:
    context = _apply(
        {
            "recompute_activation_function": {"enabled": True, "num_layers": 8},
            "recompute_norm": True,
            "swap_attention": True,
            "swap_optimizer": True,
        },
        precision="bf16",
        distributed_optimizer=True,
        num_layers=8,
    )
    assert len(context.hooks["post_model_build"]) == 3 and len(context.hooks["post_optimizer_build"]) == 1
    assert len(_apply({"reuse_fp32_param": True}, precision="bf16").hooks["post_optimizer_build"]) == 1
    block = _apply({"recompute_activation_function": True}, recompute_granularity="full", recompute_method="block")
    selective = _apply({"recompute_norm": True}, recompute_granularity="selective", recompute_method=None)
    assert len(block.hooks["post_model_build"]) == 1 and len(selective.hooks["post_model_build"]) == 1


def _apply_pipeline(settings: dict, vpp: int = 2, experts: int = 0, **extra: object) -> BuildContext:
    parallel = ParallelSizes(pp=2, vpp=vpp)
    context = BuildContext("cpu", parallel=parallel, model=ModelFacts(num_moe_experts=experts, extra=extra))
    apply_features(FeaturesConfig(optimization_level=0, settings=settings), context)
    return context


@pytest.mark.parametrize(
    ("settings", "facts", "message"),
    [
        ({"recompute_in_bubble": True}, {"vpp": 1}, "set parallel.vpp >= 2"),
        ({"recompute_in_bubble": True}, {"recompute_granularity": "full"}, "unset model.recompute_granularity"),
        ({"recompute_in_bubble": True}, {"recompute_granularity": "selective"}, "unset model.recompute_granularity"),
        ({"recompute_in_bubble": True}, {"experts": 4}, "use it on dense models"),
        ({"recompute_in_bubble": {"enabled": True, "kept_chunks": 0}}, {}, "use kept_chunks >= 1"),
    ],
)
def test_recompute_in_bubble_refuses_with_the_fix(settings: dict, facts: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _apply_pipeline(settings, **facts)


def test_recompute_in_bubble_attaches_a_schedule_hook() -> None:
    context = _apply_pipeline({"recompute_in_bubble": True})
    (hook,) = context.hooks["pipeline_schedule"]
    assert hook.__self__.kept_chunks is None and "at most 4 chunk-forwards" in context.changes[-1].reason


BLOCK = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}


@pytest.mark.parametrize(
    ("settings", "facts", "message"),
    [
        ({"recompute_in_advance": True}, {**BLOCK, "vpp": 1}, "set parallel.vpp >= 2"),
        ({"recompute_in_advance": True}, {**BLOCK, "recompute_method": "uniform"}, "model.recompute_method: block"),
        ({"recompute_in_advance": True}, {"recompute_granularity": "selective"}, "model.recompute_granularity: full"),
        ({"recompute_in_advance": True}, {}, "model.recompute_granularity: full"),
        ({"recompute_in_advance": True}, {**BLOCK, "recompute_num_layers": 0}, "recompute_num_layers >= 1"),
        ({"recompute_in_advance": True}, {**BLOCK, "experts": 4}, "use it on dense models"),
        ({"recompute_in_advance": True, "recompute_in_bubble": True}, BLOCK, "conflict"),
    ],
)
def test_recompute_in_advance_refuses_with_the_fix(settings: dict, facts: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _apply_pipeline(settings, **facts)


def test_recompute_in_advance_takes_megatrons_block_recompute_over() -> None:
    context = _apply_pipeline({"recompute_in_advance": True}, **BLOCK)
    assert context.config_overrides == {"recompute_granularity": None}
    (install,), (schedule,) = context.hooks["post_model_build"], context.hooks["pipeline_schedule"]
    assert install.__self__ is schedule.__self__ and install.__self__.num_layers == 2
