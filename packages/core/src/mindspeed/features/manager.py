"""Deciding which features are on, checking them, and applying them in order.

:func:`apply_features` is the one place features act. It resolves every registered feature
to on or off (an explicit ``enabled`` wins; otherwise the feature is on when
``level <= optimization_level`` and :meth:`Feature.default_enabled` says so), enforces
``requires`` and ``conflicts``, validates every enabled feature before any of them changes
anything, applies them in dependency order, logs each change and returns a
:class:`~mindspeed.features.report.FeatureReport`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mindspeed.config import from_dict
from mindspeed.features.base import FEATURES, LEVELS, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.features.report import FeatureReport, FeatureStatus
from mindspeed.log import DETAIL, get_logger
from mindspeed.registry import Registry

logger = get_logger(__name__)


@dataclass
class FeaturesConfig:
    """Which features to use: the optimization level and per-feature settings.

    In a YAML recipe::

        features:
          optimization_level: 1
          settings:
            flash_attn: {impl: sdpa}
            fused_rmsnorm: false          # shorthand for {enabled: false}

    Attributes:
        optimization_level: 0, 1 or 2 (default 2, as in MindSpeed): features of a higher
            level are off unless enabled explicitly.
        settings: feature name -> that feature's ``Config`` fields (a mapping, a ``Config``
            instance, or a bool for ``enabled``). Unknown names and fields are errors.
    """

    optimization_level: int = 2
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.optimization_level not in LEVELS:
            raise ValueError(
                f"optimization_level={self.optimization_level!r} is not one of "
                f"{', '.join(map(str, LEVELS))} (0 portability, 1 kernels, 2 algorithms)"
            )

    def config_for(self, feature: Feature) -> FeatureConfig:
        """``feature``'s typed config built from :attr:`settings` (defaults when absent).

        Raises:
            ValueError: for an unknown field or a value of the wrong type.
        """
        raw = self.settings.get(feature.name)
        if raw is None:
            return feature.Config()
        if isinstance(raw, bool):
            return feature.Config(enabled=raw)
        if isinstance(raw, feature.Config):
            return raw
        if isinstance(raw, Mapping):
            return from_dict(feature.Config, raw, path=f"settings.{feature.name}.")
        raise ValueError(
            f"settings.{feature.name} must be a mapping of {feature.Config.__qualname__} "
            f"fields or true/false, got {raw!r}"
        )


def resolve_features(
    cfg: FeaturesConfig, ctx: BuildContext, registry: Registry[Feature] | None = None
) -> tuple[dict[str, FeatureConfig], list[FeatureStatus]]:
    """Decide which features are on, without validating or applying anything.

    Args:
        cfg: the features config.
        ctx: the facts default decisions depend on.
        registry: the features to consider (default: every registered feature).

    Returns:
        Each feature's typed config, and each feature's status in registration order.

    Raises:
        ValueError: for an unknown feature name in ``cfg.settings`` (with the closest match),
            an unknown or disabled requirement of an explicitly enabled feature, or two
            conflicting features that are both enabled explicitly (or both by default).
    """
    registry = FEATURES if registry is None else registry
    for name in cfg.settings:
        try:
            registry.get(name)
        except ValueError as err:
            raise ValueError(f"features settings: {err}") from None
    features: dict[str, Feature] = dict(registry.items())
    configs = {name: cfg.config_for(feature) for name, feature in features.items()}
    explicit = {name for name, c in configs.items() if c.enabled is True}
    on: dict[str, bool] = {}
    why: dict[str, str] = {}
    level = cfg.optimization_level
    for name, feature in features.items():
        if configs[name].enabled is not None:
            on[name] = configs[name].enabled
            why[name] = "enabled explicitly" if on[name] else "disabled explicitly"
        elif feature.level > level:
            on[name], why[name] = False, f"level {feature.level} > optimization level {level}"
        elif feature.default_enabled(ctx):
            on[name], why[name] = True, f"on by default (level {feature.level} <= {level}) on {ctx.accelerator}"
        else:
            on[name], why[name] = False, f"off by default: {feature.why_off_by_default(ctx)}"
    _check_conflicts(features, on, why, explicit)
    _check_requires(features, on, why, explicit)
    for name, feature in features.items():
        if not on[name] and configs[name].enabled is None and configs[name] != feature.Config():
            # Knobs set on a feature that is off do nothing: say so rather than ignore them silently.
            why[name] += f"; settings.{name} are ignored (set settings.{name}.enabled=true to use them)"
            logger.warning("feature %r is off (%s)", name, why[name])
    statuses = [FeatureStatus(name, f.level, on[name], why[name]) for name, f in features.items()]
    return configs, statuses


def _check_conflicts(
    features: dict[str, Feature], on: dict[str, bool], why: dict[str, str], explicit: set[str]
) -> None:
    # A conflict declared on either side counts; one naming an unregistered feature is moot.
    pairs: list[tuple[str, str]] = []
    for name, feature in features.items():
        for other in feature.conflicts:
            if other in features and (other, name) not in pairs and (name, other) not in pairs:
                pairs.append((name, other))
    for a, b in pairs:
        if not (on[a] and on[b]):
            continue
        if (a in explicit) != (b in explicit):  # the explicit choice wins over a default
            loser, winner = (b, a) if a in explicit else (a, b)
            on[loser], why[loser] = False, f"off: conflicts with {winner!r}, which is enabled explicitly"
            continue
        raise ValueError(
            f"features {a!r} and {b!r} conflict and both are {'enabled explicitly' if a in explicit else 'on by default'}; "
            f"turn one off: settings.{a}.enabled=false or settings.{b}.enabled=false"
        )


def _check_requires(features: dict[str, Feature], on: dict[str, bool], why: dict[str, str], explicit: set[str]) -> None:
    changed = True
    while changed:  # turning a default feature off can leave another one without its requirement
        changed = False
        for name, feature in features.items():
            if not on[name]:
                continue
            for needed in feature.requires:
                if needed not in features:
                    raise ValueError(
                        f"feature {name!r} requires feature {needed!r}, which is not registered "
                        f"(known: {', '.join(features)}); register it or turn {name!r} off"
                    )
                if on[needed]:
                    continue
                if name in explicit:
                    raise ValueError(
                        f"feature {name!r} requires feature {needed!r}, which is off ({why[needed]}); "
                        f"enable it with settings.{needed}.enabled=true or turn {name!r} off with "
                        f"settings.{name}.enabled=false"
                    )
                on[name], why[name], changed = False, f"off: requires {needed!r}, which is off", True
                break


def order_features(names: list[str], registry: Registry[Feature] | None = None) -> list[str]:
    """``names`` in dependency order: every feature after the ones it requires.

    Ties keep the order of ``names`` (registration order), so the order is deterministic.

    Raises:
        ValueError: naming the features of a ``requires`` cycle.
    """
    registry = FEATURES if registry is None else registry
    pending = {name: [r for r in registry.get(name).requires if r in names] for name in names}
    ordered: list[str] = []
    while pending:
        ready = [name for name, needs in pending.items() if all(r in ordered for r in needs)]
        if not ready:
            raise ValueError(
                f"features require each other in a cycle: {_find_cycle(pending)}; remove one of these requires"
            )
        ordered.append(ready[0])
        del pending[ready[0]]
    return ordered


def _find_cycle(pending: dict[str, list[str]]) -> str:
    # Every pending node has an unmet requirement among the pending ones: walk until a repeat.
    path = [next(iter(pending))]
    while True:
        step = next(r for r in pending[path[-1]] if r in pending)
        if step in path:
            cycle = path[path.index(step) :] + [step]
            return " -> ".join(f"{n!r}" for n in cycle)
        path.append(step)


def apply_features(
    cfg: FeaturesConfig, ctx: BuildContext, *, registry: Registry[Feature] | None = None
) -> FeatureReport:
    """Resolve, check, order and apply the features; the one explicit call that changes anything.

    Every enabled feature is validated before the first one is applied, so a bad setting
    leaves ``ctx`` untouched. Each change is logged and listed in the returned report.

    Args:
        cfg: the optimization level and per-feature settings.
        ctx: the build context the features change (once: a context takes features one time).
        registry: the features to consider (default: every registered feature).

    Returns:
        The report: each feature's status, the application order and every change.

    Raises:
        ValueError: for an unknown feature or setting, an unmet requirement, a conflict, a
            ``requires`` cycle or a failed validation, each naming the features and the fix.
    """
    registry = FEATURES if registry is None else registry
    if ctx.features_applied:
        raise ValueError("this BuildContext already had features applied; build a new BuildContext per model build")
    configs, statuses = resolve_features(cfg, ctx, registry)
    order = order_features([s.name for s in statuses if s.enabled], registry)
    for name in order:
        registry.get(name).validate(configs[name], ctx)
    ctx.features_applied = True
    for name in order:
        already = len(ctx.changes)
        with ctx.applying(name):
            returned = registry.get(name).apply(configs[name], ctx)
        made = list(ctx.changes[already:])
        if list(returned or []) != made:  # a feature's report must be the truth about what it did
            raise RuntimeError(
                f"feature {name!r}: apply() returned {len(returned or [])} changes but made "
                f"{len(made)}; return exactly the Changes the BuildContext methods gave back"
            )
        for change in made:
            logger.info(change.describe(), extra=DETAIL)
    logger.info(
        "features at optimization level %d on %s: %s",
        cfg.optimization_level,
        ctx.accelerator,
        ", ".join(order) or "none enabled",
        extra=DETAIL,
    )
    return FeatureReport(
        optimization_level=cfg.optimization_level,
        facts=ctx.facts(),
        statuses=statuses,
        order=order,
        changes=list(ctx.changes),
        kernel_impls=dict(ctx.kernel_impls),
        config_overrides=dict(ctx.config_overrides),
        hooks={point: [_qualname(fn) for fn in fns] for point, fns in ctx.hooks.items() if fns},
    )


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
