"""The feature unit: one small class per acceleration feature, applied by an explicit call.

A :class:`Feature` owns everything about one feature: its typed config, its optimization level,
the MindSpeed / Megatron flags it stands for, the features it needs or excludes, the checks
on its settings and what it changes. It changes nothing when it is defined, registered or
imported: :func:`mindspeed.features.apply_features` calls :meth:`Feature.apply` on a
:class:`~mindspeed.features.context.BuildContext`, whose methods record every change.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mindspeed.features.change import Change, to_jsonable
from mindspeed.registry import Registry

if TYPE_CHECKING:
    from mindspeed.features.context import BuildContext

__all__ = ["LEVELS", "FEATURES", "Change", "Feature", "FeatureConfig", "register_feature", "to_jsonable"]

#: Optimization levels, as in MindSpeed's ``--optimization-level``.
LEVELS = {
    0: "portability: what a model needs to run correctly on the accelerator",
    1: "device-affine kernels: fused or vendor kernels where a faster one exists",
    2: "advanced algorithms: memory and communication techniques",
}

_SNAKE_CASE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")


@dataclass
class FeatureConfig:
    """The settings every feature has; a feature's ``Config`` subclasses it and adds its knobs.

    Attributes:
        enabled: ``True`` or ``False`` to force the feature on or off; ``None`` (default) lets
            the optimization level and :meth:`Feature.default_enabled` decide.
    """

    enabled: bool | None = None


class Feature:
    """Base class of every feature (subclass it, fill the class attributes, register an instance).

    Attributes:
        name: snake_case registry key; also the section name in ``FeaturesConfig.settings``.
        Config: the feature's config dataclass (a :class:`FeatureConfig` subclass).
        level: 0 (portability), 1 (device-affine kernels) or 2 (advanced algorithms); the
            feature is on by default only when ``level <= optimization_level``.
        flags: the MindSpeed / Megatron command-line flags it corresponds to.
        requires: features that must be enabled too (they are applied first).
        conflicts: features that cannot be enabled together with this one.
        description: one line for ``mindspeed features`` and the docs.
        targets: what :meth:`apply` may change (``"kernel_impls.rms_norm"``), for listings.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[FeatureConfig]] = FeatureConfig
    level: ClassVar[int] = 2
    flags: ClassVar[tuple[str, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    targets: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:  # an intermediate base such as KernelFeature
            return
        # Catch definition mistakes when the class is written, not when a run starts.
        if not _SNAKE_CASE.match(cls.name):
            raise ValueError(f"feature name {cls.name!r} ({cls.__qualname__}) must be snake_case")
        if cls.level not in LEVELS:
            raise ValueError(f"feature {cls.name!r}: level {cls.level!r} is not one of {sorted(LEVELS)}")
        if not (dataclasses.is_dataclass(cls.Config) and issubclass(cls.Config, FeatureConfig)):
            raise ValueError(f"feature {cls.name!r}: Config must be a dataclass subclassing FeatureConfig")
        if cls.name in cls.requires or cls.name in cls.conflicts:
            raise ValueError(f"feature {cls.name!r} cannot require or conflict with itself")

    def default_enabled(self, ctx: BuildContext) -> bool:
        """Whether the feature is on when its level allows it and the config does not say.

        The base answer is ``False``: a feature is opt-in unless it knows it helps here (a
        kernel feature answers whether a faster kernel exists on ``ctx.accelerator``).
        """
        return False

    def why_off_by_default(self, ctx: BuildContext) -> str:
        """Why :meth:`default_enabled` is false here, for the report (override with specifics)."""
        return "opt-in: enable it explicitly"

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """Check ``cfg`` against the facts in ``ctx``; called only when the feature is enabled.

        Raises:
            ValueError: naming the feature, the bad setting and the fix (see :meth:`invalid`).
        """

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Make the feature's changes through ``ctx``'s methods and return them."""
        raise NotImplementedError(f"feature {self.name!r} does not implement apply()")

    def invalid(self, problem: str, fix: str) -> ValueError:
        """A ``ValueError`` that names this feature, the problem and the fix (raise it)."""
        return ValueError(
            f"feature {self.name!r}: {problem}; {fix} (or turn the feature off: settings.{self.name}.enabled=false)"
        )

    def info(self) -> dict[str, Any]:
        """Static facts about the feature as plain data (for listings and docs)."""
        return {
            "name": self.name,
            "level": self.level,
            "flags": list(self.flags),
            "requires": list(self.requires),
            "conflicts": list(self.conflicts),
            "description": self.description,
            "targets": list(self.targets),
            "config": to_jsonable(dataclasses.asdict(self.Config())),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, level={self.level})"


#: Every registered feature, by name. The manifest (``mindspeed/features/__init__.py``) fills it.
FEATURES: Registry[Feature] = Registry("feature")


def register_feature(feature: Feature | type[Feature], registry: Registry[Feature] | None = None) -> Feature:
    """Register a feature (an instance, or a class that is instantiated) and return the instance.

    Args:
        feature: the feature or its class.
        registry: where to register (default: :data:`FEATURES`); tests pass a fresh one.

    Raises:
        ValueError: if the feature has no name or the name is taken.
    """
    instance = feature() if isinstance(feature, type) else feature
    if not instance.name:
        raise ValueError(f"{type(instance).__qualname__} has no name; set the class attribute `name`")
    (FEATURES if registry is None else registry).register(instance.name, instance)
    return instance
