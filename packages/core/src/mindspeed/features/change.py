"""What a feature changed (:class:`Change`) and how its values become JSON (:func:`to_jsonable`).

A leaf module: :mod:`mindspeed.features.base` and :mod:`mindspeed.features.context` both use
it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Change:
    """One change a feature made to a :class:`~mindspeed.features.context.BuildContext`.

    Attributes:
        feature: the feature's name (``"user"`` for a change made outside ``apply_features``).
        target: what changed, as ``<seam>.<key>`` (``"kernel_impls.rms_norm"``).
        before: the value before (``None`` when unset).
        after: the value after.
        reason: why, in a few words (``"impl='auto' on cpu"``).
    """

    feature: str
    target: str
    before: Any
    after: Any
    reason: str = ""

    def describe(self) -> str:
        """One line for the log and the report."""
        why = f" ({self.reason})" if self.reason else ""
        return f"[feature] {self.feature}: {self.target}: {self.before!r} -> {self.after!r}{why}"

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable data (values that are not JSON become their repr)."""
        return {
            "feature": self.feature,
            "target": self.target,
            "before": to_jsonable(self.before),
            "after": to_jsonable(self.after),
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Change:
        """Inverse of :meth:`to_dict`."""
        return cls(data["feature"], data["target"], data["before"], data["after"], data.get("reason", ""))


def to_jsonable(value: Any) -> Any:
    """``value`` as JSON data: containers recursively, callables by qualified name, else repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)
