"""One run per output directory: an exclusive lock file, ``DIR/.mindspeed.lock``.

Two runs writing the same ``checkpoint.save`` corrupt each other (both write ``iter_0000008``,
one resumes from the other's half-finished run). A run therefore takes :class:`RunLock` on its
output directory before anything reads or writes there, and a second run on the same directory
stops at once with one line naming the holder (host, pid, since when, command) and the fix.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on an open file: the kernel releases it when the
holder dies in any way (``kill -9`` included), so a run killed without cleaning up leaves a
file but no lock, and the next run takes it over with one warning naming the run that died.
The holder's details are written into the file for the message. Forked children (checkpoint
writers, data workers) close their copy of the descriptor, so they never hold the lock after
their parent died. On file systems without ``flock`` the file itself is the lock
(``O_CREAT | O_EXCL``); a lock file there whose holder is a dead process on this host is taken
over with one warning. The lock is released and its file removed on every exit path that runs
Python's ``finally`` (a normal end, an error, SIGTERM / Ctrl-C handled by the run).

Only one process of a run takes it: the launcher (which holds it while its ranks run) of node 0
(a run of several nodes shares its save directory: the launchers of the other nodes do not take
it), or under ``torchrun`` global rank 0 (:func:`takes_run_lock`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from mindspeed.config import ConfigError
from mindspeed.log import get_logger

logger = get_logger(__name__)

#: The lock file's name inside the locked directory.
LOCK_FILE = ".mindspeed.lock"
#: ``flock`` errors that mean "not supported here" (then the exclusive-create fallback).
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP}
_held_fds: set[int] = set()
_fork_hook = [False]


class DirectoryLocked(ConfigError):
    """Another run holds the directory's lock (a user error: exit 2, one line)."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock: what the lock file records."""

    host: str
    pid: int
    since: str
    command: str

    @classmethod
    def me(cls) -> LockHolder:
        """This process."""
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), now, " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        """The holder a lock file's text records (``None``: empty or unreadable)."""
        try:
            data = json.loads(text)
            return cls(str(data["host"]), int(data["pid"]), str(data["since"]), str(data.get("command", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        """``pid 123 on host-a since 2026-01-01T10:00:00+00:00 (mindspeed-llm pretrain ...)``."""
        command = self.command if len(self.command) <= 120 else self.command[:117] + "..."
        return f"pid {self.pid} on {self.host} since {self.since}" + (f" ({command})" if command else "")

    def is_dead_here(self) -> bool:
        """Whether this holder is a process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


def takes_run_lock(node_rank: int = 0) -> bool:
    """Whether this process takes its run's lock: the launcher of node 0 (``node_rank``), or global rank 0
    under ``torchrun``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return os.environ["RANK"] == "0"
    return node_rank == 0


class RunLock:
    """The exclusive lock of one run on ``directory`` (created if missing); a context manager.

    Args:
        directory: the run's output directory (``checkpoint.save``, an ``--output`` directory).
        what: how the user named it (``checkpoint.save``, ``--save-dir``), for the messages.
        beside: the lock file goes next to ``directory`` (``.NAME.mindspeed.lock`` in its parent),
            for outputs written elsewhere and renamed into place as a whole (the converters'), which
            must stay empty until then; ``directory`` is then not created.
    """

    def __init__(self, directory: str | Path, what: str = "checkpoint.save", beside: bool = False) -> None:
        self.directory, self.what = Path(directory), what
        self.path = self.directory / LOCK_FILE
        self._home = self.directory  # the directory that holds the lock file
        if beside:
            self._home = self.directory.absolute().parent
            self.path = self._home / f".{self.directory.name}{LOCK_FILE}"
        self._fd: int | None = None
        self._exclusive = False
        self._owner = 0
        self._created_directory = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def held(self) -> bool:
        """Whether this process holds the lock now."""
        return self._owner == os.getpid() and (self._fd is not None or self._exclusive)

    def acquire(self) -> None:
        """Take the lock, or raise :class:`DirectoryLocked` naming the holder and the fix."""
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"{self.what}={str(self.directory)!r} is a file; name a directory")
        if not self._home.exists():
            self._home.mkdir(parents=True, exist_ok=True)
            self._created_directory = True
        me = LockHolder.me()
        for _ in range(5):  # a run releasing the lock removes the file under us: open it again
            fd, created = _open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DirectoryLocked(self._held_message(_read_holder(self.path))) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in _NO_FLOCK:
                    raise
                if created:  # the empty file just made: the fallback creates its own
                    self.path.unlink()
                self._acquire_exclusive(me)
                return
            if not _same_file(fd, self.path):
                os.close(fd)
                continue
            left = _read_fd(fd)
            if left and (previous := LockHolder.parse(left)) is not None:
                logger.warning(
                    "%s=%s: taking over the lock of a run that ended without releasing it (killed?): %s",
                    self.what,
                    self.directory,
                    previous.describe(),
                )
            _write_fd(fd, me)
            self._fd, self._owner = fd, os.getpid()
            _forget_in_forked_children(fd)
            return
        raise DirectoryLocked(self._held_message(_read_holder(self.path)))

    def _acquire_exclusive(self, me: LockHolder) -> None:
        # No flock on this file system: the file itself is the lock.
        for attempt in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read_holder(self.path)
                if attempt == 0 and holder is not None and holder.is_dead_here():
                    logger.warning(
                        "%s=%s: taking over the lock of a run that is no longer running: %s",
                        self.what,
                        self.directory,
                        holder.describe(),
                    )
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                    continue
                raise DirectoryLocked(self._held_message(holder)) from None
            try:
                _write_fd(fd, me)
            finally:
                os.close(fd)
            self._exclusive, self._owner = True, os.getpid()
            return

    def release(self) -> None:
        """Remove the lock file and let go (only the process that took it; idempotent)."""
        if self._owner != os.getpid():
            return
        try:
            if self._fd is not None:
                if _same_file(self._fd, self.path):
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                _held_fds.discard(self._fd)
                os.close(self._fd)
            elif self._exclusive:
                holder = _read_holder(self.path, wait_s=0.0)
                if holder is not None and holder.pid == os.getpid():
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
        finally:
            self._fd, self._exclusive, self._owner = None, False, 0
        if self._created_directory:  # nothing was written there: leave nothing behind
            with contextlib.suppress(OSError):
                self._home.rmdir()

    def _held_message(self, holder: LockHolder | None) -> str:
        who = holder.describe() if holder is not None else "another process"
        return (
            f"{self.what}={str(self.directory)!r} is in use by another run: {who}; wait for it to end or stop "
            f"it, or set {self.what} to another directory (a lock left by a run that is gone: delete {self.path})"
        )


@contextlib.contextmanager
def run_lock(
    directory: str | Path | None, what: str = "checkpoint.save", beside: bool = False, node_rank: int = 0
) -> Iterator[RunLock | None]:
    """Hold the run lock of ``directory`` for the block when this process takes it (:func:`takes_run_lock`).

    ``None`` (no output directory), a rank other than 0 under torchrun or the launcher of a node other
    than 0 (``node_rank``): nothing is locked. ``beside``: see :class:`RunLock`.
    """
    if directory is None or not takes_run_lock(node_rank):
        yield None
        return
    with RunLock(directory, what, beside) as lock:
        yield lock


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """The lock file opened for reading and writing, and whether this call created it."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(path, flags, 0o644), False


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _read_fd(fd: int) -> str:
    return os.pread(fd, 65536, 0).decode("utf-8", "replace")


def _write_fd(fd: int, holder: LockHolder) -> None:
    # The holder's details only name the run to another that finds the lock taken: on a full disk the
    # lock is held without them (that run then names "another process"), and the run goes on to
    # fail, if it must, at its first save, with that save's one-line error.
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, (json.dumps(asdict(holder)) + "\n").encode(), 0)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


def _read_holder(path: Path, wait_s: float = 0.5) -> LockHolder | None:
    # The holder writes its details right after it took the lock: give it that moment.
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = LockHolder.parse(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            holder = None
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _forget_in_forked_children(fd: int) -> None:
    # A forked child shares the open file (and so the lock): it closes its copy, so that a child
    # that outlives its parent for a moment (a checkpoint writer) does not keep the lock.
    _held_fds.add(fd)
    if not _fork_hook[0]:
        os.register_at_fork(after_in_child=_close_held_in_child)
        _fork_hook[0] = True


def _close_held_in_child() -> None:
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()
