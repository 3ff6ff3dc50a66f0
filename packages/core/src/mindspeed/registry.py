"""One registry helper for everything that is extended by registration.

Models, bridges, kernels, features, losses, rewards and data handlers all register through
:class:`Registry`, so every family behaves the same way: a duplicate key raises, an unknown
key raises a ``ValueError`` that lists the known ones.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named mapping from keys to registered objects.

    Args:
        kind: what is registered ("kernel", "bridge", ...); used in error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[Hashable, T] = {}

    def register(self, key: Hashable, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``key``; without ``obj``, return a decorator.

        Raises:
            ValueError: if ``key`` is already registered.
        """
        if obj is not None:
            self._add(key, obj)
            return obj

        def decorator(target: T) -> T:
            self._add(key, target)
            return target

        return decorator

    def _add(self, key: Hashable, obj: T) -> None:
        if key in self._entries:
            raise ValueError(
                f"{self.kind} {key!r} is already registered ({self._entries[key]!r}); "
                "pick another name or unregister the old one first"
            )
        self._entries[key] = obj

    def unregister(self, key: Hashable) -> T:
        """Remove and return the entry under ``key`` (used by tests and plugins)."""
        return self._entries.pop(self._check(key))

    def get(self, key: Hashable) -> T:
        """Return the entry under ``key``.

        Raises:
            ValueError: naming the unknown key, the closest match and every known key.
        """
        return self._entries[self._check(key)]

    def _check(self, key: Hashable) -> Hashable:
        if key not in self._entries:
            known = sorted(map(str, self._entries))
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {key!r}.{hint} Known: {', '.join(known) or '(none)'}")
        return key

    def keys(self) -> list[Hashable]:
        """The registered keys in registration order."""
        return list(self._entries)

    def items(self) -> list[tuple[Hashable, T]]:
        """The (key, entry) pairs in registration order."""
        return list(self._entries.items())

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} entries)"
