"""The replay buffer (MindSpeed-RL's TransferDock idea): experience columns addressed by row index.

Producers (rollout, reference, reward, advantage workers) and consumers (the same workers and
the trainer) never talk to each other: they read and write named columns of rows in one store.

- A producer reserves rows with :meth:`ReplayBuffer.allocate` (stamped with the policy version
  whose weights generate them) and fills columns with :meth:`~ReplayBuffer.put`.
- A consumer asks for rows whose columns it needs are all written with
  :meth:`~ReplayBuffer.wait_ready` (each row goes to each named consumer once), reads them with
  :meth:`~ReplayBuffer.get`, and the trainer frees them with :meth:`~ReplayBuffer.mark_consumed`.
- The trainer bumps the policy version with :meth:`~ReplayBuffer.advance_version` once per
  step, after the update(s) on that step's rows (mini-batch updates within a step do not count:
  a version is one rollout batch's worth of training).

Staleness (``max_staleness`` = s, ``rows_per_step`` = R, trainer version t) is enforced twice:

1. consumption: a row of version v is only handed out while ``t - v <= s``; rows that age past
   it are dropped at :meth:`~ReplayBuffer.advance_version` (counted as expired);
2. production: :meth:`~ReplayBuffer.allocate` refuses a producer whose weights are too old
   (``t - v > s``: it must sync weights first) and blocks one that would run ahead: rows are
   consumed oldest first, R per version, so with C rows already consumed at version t and a
   backlog of B live rows, new rows of version v stay fresh only while
   ``C + B + count <= (v + s - t + 1) * R``. A blocked producer goes on when rows are
   discarded (dynamic sampling), and is refused with :class:`StalenessError` once the trainer
   moves past ``v + s``: then it syncs its weights to the trainer's version and asks again.

``s = 0`` is the synchronous (on-policy) mode: the trainer only ever sees rows of its current
version, and a producer can be at most one batch of rows ahead.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: The built-in column every row has: the policy version that produced it.
VERSION = "version"


class StalenessError(RuntimeError):
    """A producer refused: its rows would be (or already are) too stale to train on."""


@dataclass
class _Row:
    version: int
    values: dict[str, Any] = field(default_factory=dict)
    taken_by: set[str] = field(default_factory=set)


class ReplayBuffer:
    """Thread-safe column store of experience rows with bounded staleness.

    Args:
        columns: the column names producers may write (``prompt_ids``, ``response_ids``,
            ``old_logp``, ``ref_logp``, ``rewards``, ``advantages``, ...).
        rows_per_step: rows the trainer consumes per policy version (prompts per step x
            samples per prompt).
        max_staleness: how many versions a row may lag the trainer when it is consumed.
        mode: ``sync`` (requires ``max_staleness == 0``) or ``async`` (requires ``>= 1``);
            default: derived from ``max_staleness``.

    Raises:
        ValueError: on bad settings (naming them).
    """

    def __init__(
        self, columns: Sequence[str], rows_per_step: int, max_staleness: int = 0, mode: str | None = None
    ) -> None:
        if rows_per_step < 1 or max_staleness < 0:
            raise ValueError(f"rows_per_step={rows_per_step} must be >= 1 and max_staleness={max_staleness} >= 0")
        mode = mode or ("sync" if max_staleness == 0 else "async")
        if mode not in ("sync", "async") or (mode == "sync") != (max_staleness == 0):
            raise ValueError(f"buffer mode {mode!r} with max_staleness={max_staleness}: sync needs 0, async needs >= 1")
        if VERSION in columns or len(set(columns)) != len(columns):
            raise ValueError(f"columns {list(columns)}: names must be distinct and {VERSION!r} is built in")
        self.columns = tuple(columns)
        self.rows_per_step, self.max_staleness, self.mode = rows_per_step, max_staleness, mode
        self._cond = threading.Condition()
        self._rows: dict[int, _Row] = {}
        self._next_id = 0
        self._version = 0
        self._consumed_now = 0  # rows consumed at the current version
        self._closed = False
        self._counts = Counter()
        self._staleness = Counter()

    # -- trainer -----------------------------------------------------------------------------

    def get_version(self) -> int:
        """The trainer's current policy version."""
        with self._cond:
            return self._version

    def advance_version(self, version: int | None = None) -> list[int]:
        """Set the trainer's version (default: one more) and drop rows that became too stale.

        Returns:
            The indices of the rows dropped (expired).

        Raises:
            ValueError: if the version would go backwards.
        """
        with self._cond:
            new = self._version + 1 if version is None else version
            if new < self._version:
                raise ValueError(f"policy version cannot go back from {self._version} to {new}")
            if new != self._version:
                self._consumed_now = 0
            self._version = new
            expired = [i for i, row in self._rows.items() if new - row.version > self.max_staleness]
            for i in expired:
                del self._rows[i]
            self._counts["expired"] += len(expired)
            self._cond.notify_all()
            return expired

    # -- producers ---------------------------------------------------------------------------

    def _capacity(self, version: int) -> int:
        slots = (version + self.max_staleness - self._version + 1) * self.rows_per_step
        return slots - self._consumed_now - len(self._rows)

    def can_allocate(self, count: int, version: int) -> bool:
        """Whether :meth:`allocate` would admit ``count`` rows of ``version`` now (never blocks)."""
        with self._cond:
            return self._version - self.max_staleness <= version <= self._version and self._capacity(version) >= count

    def allocate(self, count: int, version: int, timeout: float | None = None) -> list[int]:
        """Reserve ``count`` new rows produced by policy ``version``.

        Blocks while the rows would run further ahead of the trainer than ``max_staleness``
        allows, up to ``timeout`` seconds (None: no limit); rows discarded meanwhile make room,
        and a trainer that moves on makes ``version`` too old (StalenessError).

        Returns:
            The new row indices (increasing, never reused).

        Raises:
            StalenessError: the producer's weights are too old (sync them), or the wait timed out.
            ValueError: ``version`` is ahead of the trainer, or ``count`` can never fit.
        """
        limit = (self.max_staleness + 1) * self.rows_per_step
        if not 0 < count <= limit:
            raise ValueError(
                f"cannot allocate {count} rows: between 1 and (max_staleness + 1) x rows_per_step = {limit}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                if version > self._version:
                    raise ValueError(f"producer version {version} is ahead of the trainer's {self._version}")
                if self._version - version > self.max_staleness:
                    raise StalenessError(
                        f"rows of policy version {version} would be consumed at version {self._version} or later, "
                        f"more than max_staleness={self.max_staleness} behind: sync the producer's weights first"
                    )
                if self._capacity(version) >= count:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise StalenessError(
                        f"{count} more rows of version {version} would run more than max_staleness="
                        f"{self.max_staleness} versions ahead of the trainer (version {self._version}, "
                        f"{len(self._rows)} rows waiting); refused after {timeout} s"
                    )
                self._cond.wait(remaining)
            start = self._next_id
            self._next_id += count
            for i in range(start, start + count):
                self._rows[i] = _Row(version)
            self._counts["allocated"] += count
            self._cond.notify_all()
            return list(range(start, start + count))

    def put(self, column: str, indices: Sequence[int], values: Any, overwrite: bool = False) -> None:
        """Write ``values[k]`` into ``column`` of row ``indices[k]``.

        Args:
            column: one of the buffer's columns.
            indices: live row indices.
            values: a sequence (or a tensor, split along its first dimension) of ``len(indices)``.
            overwrite: allow replacing a value already written (default: an error, which
                catches two producers writing the same cell).

        Raises:
            ValueError: unknown column, a row that is not live, a length mismatch, or a rewrite.
        """
        if column not in self.columns:
            raise ValueError(f"unknown column {column!r}; the buffer has {', '.join(self.columns)}")
        indices = [int(i) for i in indices]
        if len(values) != len(indices):
            raise ValueError(f"put {column!r}: {len(values)} values for {len(indices)} rows")
        rows = [values[k].clone() if hasattr(values[k], "clone") else values[k] for k in range(len(indices))]
        with self._cond:
            self._check_open()
            targets = [self._live(i) for i in indices]
            if not overwrite:
                again = [i for i, row in zip(indices, targets) if column in row.values]
                if again:
                    raise ValueError(
                        f"put {column!r}: rows {again[:5]} already have it (pass overwrite=True to replace)"
                    )
            for row, value in zip(targets, rows):
                row.values[column] = value
            self._cond.notify_all()

    def discard(self, indices: Sequence[int]) -> None:
        """Drop rows that will not be trained on (e.g. groups dynamic sampling filters out)."""
        with self._cond:
            for i in indices:
                if self._rows.pop(int(i), None) is not None:
                    self._counts["discarded"] += 1
            self._cond.notify_all()

    # -- consumers ---------------------------------------------------------------------------

    def _ready(self, columns: Sequence[str], consumer: str) -> list[int]:
        return [
            i for i, row in self._rows.items() if consumer not in row.taken_by and all(c in row.values for c in columns)
        ]

    def ready_count(self, columns: Sequence[str], consumer: str = "trainer") -> int:
        """How many rows :meth:`wait_ready` could hand ``consumer`` now."""
        self._check_columns(columns)
        with self._cond:
            return len(self._ready(columns, consumer))

    def wait_ready(
        self, columns: Sequence[str], count: int, consumer: str = "trainer", timeout: float | None = None
    ) -> list[int]:
        """Take ``count`` rows whose ``columns`` are all written and that ``consumer`` has not taken yet.

        The oldest rows come first. Taken rows are not handed to the same consumer again
        (two workers of one role get disjoint rows); other consumers still see them.

        Returns:
            ``count`` row indices.

        Raises:
            TimeoutError: fewer than ``count`` rows were ready after ``timeout`` seconds.
            RuntimeError: the buffer was closed while waiting.
        """
        self._check_columns(columns)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                ready = self._ready(columns, consumer)
                if len(ready) >= count:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"{len(ready)} of {count} rows with {', '.join(columns)} ready for {consumer!r} "
                        f"after {timeout} s"
                    )
                self._cond.wait(remaining)
            taken = sorted(ready)[:count]
            for i in taken:
                self._rows[i].taken_by.add(consumer)
            return taken

    def get(self, columns: Sequence[str], indices: Sequence[int]) -> dict[str, list[Any]]:
        """Column name -> values of ``indices`` (in that order); ``version`` is always readable.

        Raises:
            ValueError: unknown column, a row that is not live, or a value not written yet.
        """
        self._check_columns(columns)
        with self._cond:
            rows = [self._live(int(i)) for i in indices]
            out: dict[str, list[Any]] = {}
            for column in columns:
                if column == VERSION:
                    out[column] = [row.version for row in rows]
                    continue
                missing = [i for i, row in zip(indices, rows) if column not in row.values]
                if missing:
                    raise ValueError(f"column {column!r} is not written yet for rows {missing[:5]}")
                out[column] = [row.values[column] for row in rows]
            return out

    def mark_consumed(self, indices: Sequence[int]) -> None:
        """Free rows the trainer is done with (rows already expired or freed are skipped)."""
        with self._cond:
            for i in indices:
                i = int(i)
                if not 0 <= i < self._next_id:
                    raise ValueError(f"row {i} was never allocated")
                row = self._rows.pop(i, None)
                if row is not None:
                    self._counts["consumed"] += 1
                    self._consumed_now += 1
                    self._staleness[self._version - row.version] += 1
            self._cond.notify_all()

    # -- housekeeping ------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every row (the version and the counters stay)."""
        with self._cond:
            self._counts["cleared"] += len(self._rows)
            self._rows.clear()
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting producer and consumer with an error (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Version, live rows, lifetime counters and the staleness of consumed rows."""
        with self._cond:
            consumed = sum(self._staleness.values())
            return {
                "version": self._version,
                "live_rows": len(self._rows),
                "max_staleness": self.max_staleness,
                **{name: self._counts[name] for name in ("allocated", "consumed", "discarded", "expired", "cleared")},
                "staleness_histogram": dict(sorted(self._staleness.items())),
                "staleness_mean": sum(k * n for k, n in self._staleness.items()) / consumed if consumed else 0.0,
                "staleness_max": max(self._staleness, default=0),
            }

    def _live(self, i: int) -> _Row:
        row = self._rows.get(i)
        if row is None:
            raise ValueError(f"row {i} is not in the buffer (never allocated, consumed, discarded or expired)")
        return row

    def _check_columns(self, columns: Sequence[str]) -> None:
        unknown = [c for c in columns if c not in self.columns and c != VERSION]
        if unknown:
            raise ValueError(f"unknown column(s) {', '.join(unknown)}; the buffer has {', '.join(self.columns)}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the replay buffer is closed")
