"""Version-checked, reversible patches of upstream code, for where it has no seam.

A patch names its target (``"package.module.attr"`` or ``"package.module.Class.attr"``), the
distribution and version range it was written for, the accelerators it applies to and why it
exists. Applying checks the installed version and that the target exists; reverting restores
exactly what was there (or removes what was added). Nothing is patched on import: a
:class:`PatchSet` is applied by an explicit call and reports what it did.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mindspeed.log import get_logger

logger = get_logger(__name__)

_MISSING = object()


class PatchError(RuntimeError):
    """A patch cannot be applied here (version out of range, target gone)."""


def resolve_target(target: str) -> tuple[Any, str]:
    """Split ``"pkg.mod.Class.attr"`` into (owner object, attribute name), importing the module."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise PatchError(f"cannot import any module of patch target {target!r}")


def installed_version(distribution: str) -> Version | None:
    """The installed version of ``distribution`` (``None`` if absent)."""
    try:
        return Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class UpstreamPatch:
    """One replacement of an upstream attribute.

    Attributes:
        name: short id shown in reports.
        target: dotted path of the attribute to replace.
        make: ``make(original, accelerator) -> replacement``; ``original`` is ``None`` when the
            attribute does not exist and ``allow_missing`` is set.
        distribution: the PyPI distribution that owns the target ("megatron-core", "torch").
        versions: the version range the patch was written and tested for (PEP 440).
        reason: why upstream needs it (shown in the report).
        accelerators: accelerator names it applies to (empty: all).
        allow_missing: the target may be absent (the patch then adds it, and revert deletes it).
        condition: ``condition() -> bool``; the patch is skipped when it says no (e.g. "only
            when Transformer Engine is absent").
    """

    name: str
    target: str
    make: Callable[[Any, Any], Any]
    distribution: str
    versions: str
    reason: str
    accelerators: tuple[str, ...] = ()
    allow_missing: bool = False
    condition: Callable[[], bool] | None = None
    _saved: Any = field(default=_MISSING, init=False, repr=False)
    _owner: Any = field(default=None, init=False, repr=False)

    def applies_to(self, accelerator_name: str) -> bool:
        """Whether the patch is meant for ``accelerator_name`` (and its condition holds)."""
        if self.accelerators and accelerator_name not in self.accelerators:
            return False
        return self.condition is None or bool(self.condition())

    def check_version(self) -> None:
        """Raise :class:`PatchError` if the installed distribution is outside ``versions``."""
        version = installed_version(self.distribution)
        if version is None:
            raise PatchError(f"patch {self.name}: {self.distribution} is not installed")
        if version not in SpecifierSet(self.versions):
            raise PatchError(
                f"patch {self.name} targets {self.distribution}{self.versions} but {version} is installed; "
                f"install a supported version or update the patch ({self.target})"
            )

    @property
    def applied(self) -> bool:
        """Whether the patch is in place."""
        return self._owner is not None

    def apply(self, accelerator: Any) -> None:
        """Replace the target; remembers the original for :meth:`revert`."""
        if self.applied:
            raise PatchError(f"patch {self.name} is already applied")
        self.check_version()
        owner, attr = resolve_target(self.target)
        original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
        if original is _MISSING and not self.allow_missing:
            raise PatchError(
                f"patch {self.name}: {self.target} does not exist in {self.distribution} "
                f"{installed_version(self.distribution)}"
            )
        replacement = self.make(None if original is _MISSING else _unwrap(original), accelerator)
        setattr(owner, attr, replacement)
        self._owner, self._saved = owner, original

    def revert(self) -> None:
        """Put back exactly what was there before :meth:`apply`."""
        if not self.applied:
            return
        _, attr = self.target.rsplit(".", 1)
        if self._saved is _MISSING:
            delattr(self._owner, attr)
        else:
            setattr(self._owner, attr, self._saved)
        self._owner, self._saved = None, _MISSING


def _unwrap(value: Any) -> Any:
    # staticmethod objects fetched from a class __dict__ are unwrapped to the function.
    return value.__func__ if isinstance(value, staticmethod) else value


@dataclass
class PatchRecord:
    """One line of a patch report."""

    name: str
    target: str
    distribution: str
    versions: str
    reason: str


class PatchSet:
    """An ordered group of patches applied and reverted together (all or nothing)."""

    def __init__(self, patches: Iterable[UpstreamPatch]) -> None:
        self.patches = list(patches)
        self._applied: list[UpstreamPatch] = []

    def apply(self, accelerator: Any) -> list[PatchRecord]:
        """Apply every patch meant for ``accelerator``; on any failure revert what was applied."""
        try:
            for patch in self.patches:
                if patch.applies_to(accelerator.name):
                    patch.apply(accelerator)
                    self._applied.append(patch)
                    logger.debug("patched %s (%s)", patch.target, patch.name)
        except Exception:
            self.revert()
            raise
        return [PatchRecord(p.name, p.target, p.distribution, p.versions, p.reason) for p in self._applied]

    def add(self, patch: UpstreamPatch, accelerator: Any) -> PatchRecord:
        """Apply one more patch as part of this set (reverted with the others)."""
        self.patches.append(patch)
        patch.apply(accelerator)
        self._applied.append(patch)
        return PatchRecord(patch.name, patch.target, patch.distribution, patch.versions, patch.reason)

    def revert(self) -> None:
        """Revert in reverse order."""
        while self._applied:
            self._applied.pop().revert()
