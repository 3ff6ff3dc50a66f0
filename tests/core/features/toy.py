"""Test-only features registered in a fresh registry (never in mindspeed.features.FEATURES)."""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.features import BuildContext, Change, Feature, FeatureConfig, register_feature
from mindspeed.registry import Registry


@dataclass
class ToyConfig(FeatureConfig):
    value: int = 1


class ToyFeature(Feature):
    """Sets config_overrides[<name>] = cfg.value; on by default when ``default_on``."""

    Config = ToyConfig
    default_on = True

    def default_enabled(self, ctx: BuildContext) -> bool:
        return self.default_on

    def validate(self, cfg: ToyConfig, ctx: BuildContext) -> None:
        if cfg.value < 0:
            raise self.invalid(f"settings.{self.name}.value={cfg.value} is negative", "use a value >= 0")

    def apply(self, cfg: ToyConfig, ctx: BuildContext) -> list[Change]:
        return [ctx.set_config(self.name, cfg.value, reason="toy")]


def toy(
    name: str,
    *,
    level: int = 1,
    requires: tuple[str, ...] = (),
    conflicts: tuple[str, ...] = (),
    default_on: bool = True,
) -> type[ToyFeature]:
    """A ToyFeature subclass with these class attributes."""
    return type(
        f"Toy_{name}",
        (ToyFeature,),
        {
            "name": name,
            "level": level,
            "requires": requires,
            "conflicts": conflicts,
            "default_on": default_on,
            "description": f"toy {name}",
        },
    )


def registry_of(*classes: type[Feature]) -> Registry[Feature]:
    """A fresh feature registry holding instances of ``classes`` in order."""
    registry: Registry[Feature] = Registry("feature")
    for cls in classes:
        register_feature(cls, registry)
    return registry
