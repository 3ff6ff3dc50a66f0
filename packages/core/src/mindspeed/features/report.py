"""The run report of :func:`~mindspeed.features.apply_features`: what was on, why, and every change."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindspeed.features.change import Change, to_jsonable


@dataclass(frozen=True)
class FeatureStatus:
    """Whether one feature was on, and why.

    Attributes:
        name: the feature. level: its optimization level. enabled: whether it was applied.
        why: the deciding rule (``"enabled explicitly"``, ``"level 1 > optimization level 0"``, ...).
    """

    name: str
    level: int
    enabled: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {"name": self.name, "level": self.level, "enabled": self.enabled, "why": self.why}


@dataclass
class FeatureReport:
    """The outcome of applying features to one :class:`~mindspeed.features.context.BuildContext`.

    Attributes:
        optimization_level: the level the defaults were decided at.
        facts: the context's read-only facts (accelerator, parallel sizes, model facts).
        statuses: one entry per registered feature, in registration order.
        order: the enabled features in the order they were applied.
        changes: every change, in order.
        kernel_impls, config_overrides, hooks: the seams after all features ran
            (hooks by qualified name).
    """

    optimization_level: int
    facts: dict[str, Any]
    statuses: list[FeatureStatus]
    order: list[str]
    changes: list[Change]
    kernel_impls: dict[str, str] = field(default_factory=dict)
    config_overrides: dict[str, Any] = field(default_factory=dict)
    hooks: dict[str, list[str]] = field(default_factory=dict)

    @property
    def enabled(self) -> list[str]:
        """Names of the applied features, in application order."""
        return list(self.order)

    def status(self, name: str) -> FeatureStatus:
        """The status of feature ``name``.

        Raises:
            KeyError: if the feature was not in the registry the report was made from.
        """
        for status in self.statuses:
            if status.name == name:
                return status
        raise KeyError(name)

    def changes_of(self, name: str) -> list[Change]:
        """The changes feature ``name`` made."""
        return [c for c in self.changes if c.feature == name]

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable data; :meth:`from_dict` reads it back."""
        return {
            "optimization_level": self.optimization_level,
            "facts": to_jsonable(self.facts),
            "features": [s.to_dict() for s in self.statuses],
            "order": list(self.order),
            "changes": [c.to_dict() for c in self.changes],
            "kernel_impls": dict(self.kernel_impls),
            "config_overrides": to_jsonable(self.config_overrides),
            "hooks": to_jsonable(self.hooks),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureReport:
        """Inverse of :meth:`to_dict`."""
        return cls(
            optimization_level=data["optimization_level"],
            facts=data["facts"],
            statuses=[FeatureStatus(**s) for s in data["features"]],
            order=list(data["order"]),
            changes=[Change.from_dict(c) for c in data["changes"]],
            kernel_impls=dict(data.get("kernel_impls", {})),
            config_overrides=dict(data.get("config_overrides", {})),
            hooks={k: list(v) for k, v in data.get("hooks", {}).items()},
        )

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON document."""
        return json.dumps(self.to_dict(), indent=indent)

    def render(self) -> str:
        """The report as text: one line per feature, then one line per change."""
        lines = [
            f"features at optimization level {self.optimization_level} on {self.facts.get('accelerator')}: "
            f"{len(self.order)} enabled, {len(self.changes)} changes"
        ]
        width = max((len(s.name) for s in self.statuses), default=0)
        for s in self.statuses:
            lines.append(f"  {'on ' if s.enabled else 'off'} {s.name:<{width}}  level {s.level}  {s.why}")
        lines.extend(f"  {change.describe()}" for change in self.changes)
        return "\n".join(lines)

    def write(self, path: str | Path) -> Path:
        """Write the JSON report to ``path`` atomically (a temporary file in the same folder, then a rename).

        Returns:
            The path written.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(self.to_json() + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        except BaseException:
            with contextlib.suppress(OSError):  # the temp file may already be gone
                os.unlink(tmp)
            raise
        return path
