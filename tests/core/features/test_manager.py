"""Resolution, requires/conflicts, validation, ordering and application of features."""

from __future__ import annotations

import logging

import pytest

from mindspeed.features import BuildContext, FeaturesConfig, apply_features, order_features, resolve_features
from tests.core.features.toy import ToyConfig, ToyFeature, registry_of, toy


def ctx() -> BuildContext:
    return BuildContext(accelerator="cpu")


def enabled(cfg: FeaturesConfig, registry) -> dict[str, bool]:
    _, statuses = resolve_features(cfg, ctx(), registry)
    return {s.name: s.enabled for s in statuses}


def test_level_decides_the_defaults() -> None:
    registry = registry_of(
        toy("base", level=0), toy("kern", level=1), toy("algo", level=2), toy("optin", level=1, default_on=False)
    )
    assert enabled(FeaturesConfig(optimization_level=0), registry) == {
        "base": True,
        "kern": False,
        "algo": False,
        "optin": False,
    }
    assert enabled(FeaturesConfig(optimization_level=1), registry) == {
        "base": True,
        "kern": True,
        "algo": False,
        "optin": False,
    }
    assert enabled(FeaturesConfig(optimization_level=2), registry) == {
        "base": True,
        "kern": True,
        "algo": True,
        "optin": False,
    }


def test_explicit_enabled_overrides_the_level() -> None:
    registry = registry_of(toy("base", level=0), toy("algo", level=2), toy("optin", level=1, default_on=False))
    cfg = FeaturesConfig(
        optimization_level=0, settings={"algo": {"enabled": True}, "base": False, "optin": ToyConfig(enabled=True)}
    )
    assert enabled(cfg, registry) == {"base": False, "algo": True, "optin": True}
    _, statuses = resolve_features(cfg, ctx(), registry)
    assert [s.why for s in statuses] == ["disabled explicitly", "enabled explicitly", "enabled explicitly"]


def test_settings_of_a_feature_that_is_off_are_reported() -> None:
    registry = registry_of(toy("algo", level=2))
    _, statuses = resolve_features(
        FeaturesConfig(optimization_level=1, settings={"algo": {"value": 3}}), ctx(), registry
    )
    assert not statuses[0].enabled
    assert "settings.algo are ignored" in statuses[0].why and "settings.algo.enabled=true" in statuses[0].why


def test_bad_optimization_level_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="optimization_level=3"):
        FeaturesConfig(optimization_level=3)
    registry = registry_of(toy("fused_thing"))
    with pytest.raises(ValueError, match="unknown feature 'fused_thng'.*Did you mean 'fused_thing'"):
        apply_features(FeaturesConfig(settings={"fused_thng": True}), ctx(), registry=registry)
    with pytest.raises(ValueError, match="settings.fused_thing.valu"):
        apply_features(FeaturesConfig(settings={"fused_thing": {"valu": 2}}), ctx(), registry=registry)


def test_missing_requirement_names_both_features() -> None:
    registry = registry_of(toy("needed", level=2), toy("needy", level=1, requires=("needed",)))
    with pytest.raises(ValueError) as err:
        apply_features(FeaturesConfig(optimization_level=1, settings={"needy": True}), ctx(), registry=registry)
    message = str(err.value)
    assert "'needy'" in message and "'needed'" in message and "settings.needed.enabled=true" in message
    # Not explicit: the dependent feature is dropped from the defaults, with the reason.
    report = apply_features(FeaturesConfig(optimization_level=1), ctx(), registry=registry)
    assert report.status("needy").enabled is False and "requires 'needed'" in report.status("needy").why
    with pytest.raises(ValueError, match="requires feature 'ghost', which is not registered"):
        apply_features(FeaturesConfig(), ctx(), registry=registry_of(toy("a", requires=("ghost",))))


def test_conflict_names_both_features_and_the_fix() -> None:
    registry = registry_of(toy("left"), toy("right", conflicts=("left",)))
    cfg = FeaturesConfig(settings={"left": True, "right": True})
    with pytest.raises(ValueError) as err:
        apply_features(cfg, ctx(), registry=registry)
    message = str(err.value)
    assert "'left'" in message and "'right'" in message
    assert "settings.left.enabled=false" in message and "settings.right.enabled=false" in message
    with pytest.raises(ValueError, match="both are on by default"):  # a defect in the defaults is caught too
        apply_features(FeaturesConfig(), ctx(), registry=registry)
    # An explicit choice wins over a default: the other side is turned off, and the report says why.
    report = apply_features(FeaturesConfig(settings={"left": True}), ctx(), registry=registry)
    assert report.order == ["left"] and "conflicts with 'left'" in report.status("right").why
    assert apply_features(FeaturesConfig(settings={"left": False}), ctx(), registry=registry).order == ["right"]


def test_validate_errors_name_feature_setting_and_fix() -> None:
    registry = registry_of(toy("first"), toy("checked"))
    context = ctx()
    with pytest.raises(ValueError) as err:
        apply_features(FeaturesConfig(settings={"checked": {"value": -1}}), context, registry=registry)
    assert str(err.value).startswith("feature 'checked': settings.checked.value=-1 is negative; use a value >= 0")
    assert context.changes == () and not context.features_applied  # validation runs before any apply


def test_requires_order_is_topological_and_cycles_fail() -> None:
    registry = registry_of(toy("c", requires=("b",)), toy("b", requires=("a",)), toy("a"), toy("d"))
    report = apply_features(FeaturesConfig(), ctx(), registry=registry)
    assert report.order == ["a", "b", "c", "d"]
    assert [c.feature for c in report.changes] == ["a", "b", "c", "d"]
    assert order_features(["d", "c", "a", "b"], registry) == ["d", "a", "b", "c"]  # ties keep the given order
    cyclic = registry_of(toy("x", requires=("y",)), toy("y", requires=("z",)), toy("z", requires=("x",)))
    with pytest.raises(ValueError, match="cycle: 'x' -> 'y' -> 'z' -> 'x'"):
        apply_features(FeaturesConfig(), ctx(), registry=cyclic)


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_changes_are_logged_and_reported() -> None:
    registry = registry_of(toy("one"), toy("two", requires=("one",)))
    context = ctx()
    # A handler on the manager's own logger: caplog's root handler misses records once an
    # entry point's setup_logging() has stopped propagation of the mindspeed loggers.
    logger, collect = logging.getLogger("mindspeed.features.manager"), Collect()
    level = logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    try:
        report = apply_features(FeaturesConfig(settings={"two": {"value": 7}}), context, registry=registry)
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    assert dict(context.config_overrides) == {"one": 1, "two": 7} == report.config_overrides
    assert [c.describe() for c in report.changes] == [
        "[feature] one: config_overrides.one: None -> 1 (toy)",
        "[feature] two: config_overrides.two: None -> 7 (toy)",
    ]
    logged = [r.getMessage() for r in collect.records]
    assert all(c.describe() in logged for c in report.changes)
    with pytest.raises(ValueError, match="already had features applied"):
        apply_features(FeaturesConfig(), context, registry=registry)


def test_apply_must_return_the_changes_it_made() -> None:
    class Sloppy(ToyFeature):
        name = "sloppy"

        def apply(self, cfg, ctx):
            ctx.set_config("x", 1)
            return []

    with pytest.raises(RuntimeError, match="'sloppy': apply\\(\\) returned 0 changes but made 1"):
        apply_features(FeaturesConfig(), ctx(), registry=registry_of(Sloppy))


def test_feature_definitions_are_checked() -> None:
    with pytest.raises(ValueError, match="snake_case"):
        toy("Bad-Name")
    with pytest.raises(ValueError, match="level 5"):
        toy("good", level=5)
    with pytest.raises(ValueError, match="itself"):
        toy("selfish", requires=("selfish",))
    with pytest.raises(ValueError, match="already registered"):
        registry_of(toy("twice"), toy("twice"))


def test_features_config_loads_from_recipes_and_overrides(tmp_path) -> None:
    from mindspeed.config import ConfigError, load_config

    recipe = tmp_path / "features.yaml"
    recipe.write_text("optimization_level: 1\nsettings:\n  flash_attn: {impl: sdpa}\n")
    cfg = load_config(FeaturesConfig, recipe, ["settings.fused_rmsnorm=false", "settings.flash_attn.enabled=true"])
    assert cfg.optimization_level == 1
    assert cfg.settings == {"flash_attn": {"impl": "sdpa", "enabled": True}, "fused_rmsnorm": False}
    with pytest.raises(ConfigError, match="optimization_level=7"):
        load_config(FeaturesConfig, None, ["optimization_level=7"])
