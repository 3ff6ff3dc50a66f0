"""Run untrusted Python in a limited subprocess: the ``python`` tool's sandbox.

What holds (see docs/rl/tools.md for the full account):

* the program runs in a fresh ``python -I -S -B -u`` (isolated: no user site, no ``PYTHON*``
  variables, no current directory on the path) in a new session, in a fresh temporary working
  directory that is removed afterwards, with a scrubbed environment (``PATH``, ``HOME`` and
  ``TMPDIR`` = that directory, the locale, a sandbox token; nothing of the caller's);
* a bootstrap sets resource limits before the program starts (it runs inside the child, so no
  ``preexec_fn`` runs in a threaded parent): CPU seconds, address space, the size of any file it
  writes (which bounds its output), open files, no core files;
* the wall clock: past ``wall_timeout_s`` the whole process group gets SIGKILL (SIGTERM handlers
  do not matter), and after every run any process still carrying the run's token in its
  environment (a child that left the group with ``setsid``) is killed too;
* the network: the bootstrap asks the kernel for a new, empty network namespace
  (``unshare(CLONE_NEWNET)``, or with a user namespace when unprivileged); where the kernel
  refuses (no capability, user namespaces disabled), the program runs with the host's network
  and the result says so (:attr:`SandboxResult.network_isolated`); ``require_network_isolation``
  refuses to run instead.

What does not hold: the file system is the host's, as the calling user sees it (the program may
read any file that user may read, and write outside its directory where permitted); the number
of processes is not limited (``RLIMIT_NPROC`` counts all of the user's processes, and root
ignores it); it is no defence against a kernel exploit. Run rollouts that execute model code as
an unprivileged user, in a container, for more.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

TOKEN_VARIABLE = "MINDSPEED_SANDBOX_TOKEN"

#: Runs in the child before the program: namespaces, then limits, then exec of the program.
BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
limits, report = json.loads(sys.argv[1]), int(sys.argv[2])
isolated = False
try:
    libc = ctypes.CDLL(None, use_errno=True)
    isolated = libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0
except Exception:
    pass
os.write(report, b"1" if isolated else b"0")
os.close(report)
if limits["require_network_isolation"] and not isolated:
    sys.exit(126)
for name, (soft, hard) in limits["rlimits"].items():
    kind = getattr(resource, name)
    ceiling = resource.getrlimit(kind)[1]
    if ceiling != resource.RLIM_INFINITY:  # never ask for more than the caller may have
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(kind, (soft, hard))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", sys.argv[3]])
"""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run.

    Attributes:
        wall_timeout_s: wall seconds before the process group is killed.
        cpu_seconds: CPU seconds (RLIMIT_CPU; the kernel sends SIGXCPU, then SIGKILL a second later).
        memory_mb: address space in MiB (RLIMIT_AS; an allocation past it fails: MemoryError).
        max_output_bytes: bytes of stdout+stderr kept (head and tail); the program may write
            :func:`capture_bytes` in all to any one file, past that a write fails (RLIMIT_FSIZE).
        max_open_files: RLIMIT_NOFILE.
        require_network_isolation: refuse to run where no network namespace can be made.
    """

    wall_timeout_s: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 4096
    max_open_files: int = 64
    require_network_isolation: bool = False

    def __post_init__(self) -> None:
        for name in ("wall_timeout_s", "cpu_seconds", "memory_mb", "max_output_bytes", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox {name}={getattr(self, name)!r}: give a positive number")


@dataclass(frozen=True)
class SandboxResult:
    """One run's outcome.

    Attributes:
        output: stdout and stderr interleaved (UTF-8, invalid bytes replaced); past the output limit,
            its first and last halves of the limit joined by ``...``.
        returncode: the exit status (negative: killed by that signal; None: it never started).
        timed_out: killed at the wall timeout.
        truncated: it wrote more than the output limit.
        overflowed: it wrote all :func:`capture_bytes` (a write past them failed in the program).
        network_isolated: it ran in its own empty network namespace.
        elapsed_s: wall seconds.
    """

    output: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    overflowed: bool
    network_isolated: bool
    elapsed_s: float


def capture_bytes(limits: SandboxLimits) -> int:
    """Bytes of output captured (the largest file the program may write): a few times what is kept."""
    return max(4 * limits.max_output_bytes, 1 << 16)


#: At most this many sandboxes run at once in this process, whatever number of callers.
MAX_PARALLEL_SANDBOXES = max(1, os.cpu_count() or 1)
_running = threading.BoundedSemaphore(MAX_PARALLEL_SANDBOXES)


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a program in the sandbox and return what it printed; waits for a free slot."""
    limits = limits or SandboxLimits()
    with _running:
        return _run(code, limits)


def _run(code: str, limits: SandboxLimits) -> SandboxResult:
    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="mindspeed-sandbox-"))
    token = uuid.uuid4().hex
    read_end, write_end = os.pipe()
    proc = None
    try:
        program = workdir / "main.py"
        program.write_text(code, encoding="utf-8", errors="replace")
        out_path = workdir.parent / f"{workdir.name}.out"  # outside the program's directory
        mb = 1 << 20
        capture = capture_bytes(limits)
        rlimits = {
            "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
            "RLIMIT_AS": (limits.memory_mb * mb, limits.memory_mb * mb),
            "RLIMIT_FSIZE": (capture, capture),
            "RLIMIT_NOFILE": (limits.max_open_files, limits.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }
        setup = json.dumps({"rlimits": rlimits, "require_network_isolation": limits.require_network_isolation})
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LC_ALL": "C.UTF-8",
            TOKEN_VARIABLE: token,
        }
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BOOTSTRAP, setup, str(write_end), str(program)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=env,
                start_new_session=True,
                pass_fds=(write_end,),
                close_fds=True,
            )
        os.close(write_end)
        write_end = -1
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # children that stayed in the group, whether or not the program ended
        proc.kill()
        proc.wait()
        _kill_by_token(token)
        isolated = os.read(read_end, 1) == b"1"
        with open(out_path, "rb") as out:
            data = out.read(capture + 1)
        out_path.unlink(missing_ok=True)
        truncated, overflowed = len(data) > limits.max_output_bytes, len(data) >= capture
        if truncated:  # the head and the tail (where a traceback ends) of what was captured
            half = limits.max_output_bytes // 2
            data = data[:half] + b"\n...\n" + data[len(data) - (limits.max_output_bytes - half) :]
        return SandboxResult(
            output=data.decode("utf-8", errors="replace"),
            returncode=proc.returncode,
            timed_out=timed_out,
            truncated=truncated,
            overflowed=overflowed,
            network_isolated=isolated,
            elapsed_s=time.perf_counter() - start,
        )
    finally:
        if proc is not None and proc.returncode is None:  # an error of ours mid-run: leave nothing behind
            _kill_group(proc.pid)
            proc.kill()
            proc.wait()
            _kill_by_token(token)
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        Path(f"{workdir}.out").unlink(missing_ok=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_by_token(token: str) -> None:
    """SIGKILL every process whose initial environment holds ``token`` (ones that left the group)."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue
