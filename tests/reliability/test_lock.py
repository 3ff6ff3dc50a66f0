"""One run per output directory (:mod:`mindspeed.checkpointing.lock`), in this process and in small real processes.

- a lock held by another open file (in this process) or by another process is refused with one
  line naming the holder (pid, host, since when, command) and the fix;
- a lock whose holder was killed (``kill -9``: the kernel drops the ``flock``) is taken over with one
  warning naming the dead run, even while a child it forked still lives;
- the file is gone after a normal exit and after an exception; after SIGTERM's default death it
  is left but not locked;
- without ``flock`` (the exclusive-create fallback): a live holder refuses, a dead pid of this host
  is taken over with one warning, another host's lock refuses;
- the commands exit 2 with one line when their output directory is held: ``mindspeed-llm pretrain``,
  ``convert-ckpt``, ``mindspeed-mm train`` / ``convert`` / ``extract-features``, ``mindspeed-rl grpo``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindspeed.checkpointing import LOCK_FILE, DirectoryLocked, RunLock, run_lock
from mindspeed.checkpointing import lock as lock_module

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="flock and /proc: Linux")

_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from mindspeed.checkpointing import RunLock
    lock = RunLock(sys.argv[1])
    lock.acquire()
    if sys.argv[2] == "fork":  # a forked child (a checkpoint writer) that outlives its parent
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    print("held", flush=True)
    time.sleep(60)
    """
)


def _hold(directory: Path, mode: str = "plain") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory), mode], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_held_locks_refuse_with_the_holder_and_dead_holders_are_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    # Held by another open file of this process: one line with the holder and the fix.
    with RunLock(out) as first:
        assert first.held and (out / LOCK_FILE).is_file()
        with pytest.raises(DirectoryLocked) as refused:
            RunLock(out).acquire()
        line = str(refused.value)
        assert "\n" not in line
        assert f"checkpoint.save='{out}' is in use by another run: pid {os.getpid()} on {socket.gethostname()}" in line
        assert " since 20" in line and "set checkpoint.save to another directory" in line
    assert not (out / LOCK_FILE).exists() and not out.exists()  # created for the run, nothing written: removed

    # Held by another process; then that process is killed with SIGKILL (and a child it forked lives on).
    out.mkdir()
    holder = _hold(out, "fork")
    try:
        with pytest.raises(DirectoryLocked, match=f"in use by another run: pid {holder.pid} on "):
            RunLock(out, "--save-dir").acquire()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        with caplog.at_level(logging.WARNING, logger="mindspeed"):
            with RunLock(out):  # the forked child still runs: it does not hold the lock
                pass
    finally:
        _kill_group(holder)
    (warning,) = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert f"pid {holder.pid} on {socket.gethostname()}" in warning and "ended without releasing it" in warning
    assert not (out / LOCK_FILE).exists() and out.is_dir()  # the directory was there before: kept


def test_release_on_error_and_after_sigterm(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), run_lock(out):
        (out / "metrics.jsonl").write_text("{}\n")
        raise RuntimeError("a failed run")
    assert not (out / LOCK_FILE).exists()
    # SIGTERM with its default action (no handler: the run had not started its loop): the file stays, unlocked.
    holder = _hold(out)
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=30)
    assert (out / LOCK_FILE).is_file()
    with caplog.at_level(logging.WARNING, logger="mindspeed"), RunLock(out):
        pass
    assert len([r for r in caplog.records if "taking over the lock" in r.getMessage()]) == 1
    assert not (out / LOCK_FILE).exists()


def test_without_flock_the_file_is_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    out = tmp_path / "run"
    with RunLock(out) as mine:
        assert mine.held
        with pytest.raises(DirectoryLocked, match=f"pid {os.getpid()} on "):
            RunLock(out).acquire()
    assert not (out / LOCK_FILE).exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"host": socket.gethostname(), "pid": int(dead.stdout), "since": "2026-01-01T00:00:00", "command": "x"}
    out.mkdir(exist_ok=True)
    (out / LOCK_FILE).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="mindspeed"), RunLock(out):
        pass
    (warning,) = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert f"pid {record['pid']}" in warning and "no longer running" in warning

    (out / LOCK_FILE).write_text(json.dumps({**record, "host": "another-host"}))
    with pytest.raises(DirectoryLocked, match="on another-host since 2026-01-01"):
        RunLock(out).acquire()


def _error_line(capsys: pytest.CaptureFixture, main, argv: list[str], prog: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    return line


def test_commands_exit_2_when_their_output_directory_is_held(
    tmp_path: Path, dataset: str, mm_model: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    from mindspeed_llm.cli import main as llm
    from mindspeed_mm.cli import main as mm
    from mindspeed_rl.cli import main as rl
    from tests.reliability import harness

    out = tmp_path / "run"
    since = f"is in use by another run: pid {os.getpid()} on {socket.gethostname()} since "
    with RunLock(out):
        line = _error_line(capsys, llm, ["pretrain", *harness.recipe(dataset, out)], "mindspeed-llm")
        assert f"checkpoint.save='{out}' {since}" in line
        line = _error_line(capsys, mm, ["train", *harness.mm_recipe(*mm_model, out)], "mindspeed-mm")
        assert f"checkpoint.save='{out}' {since}" in line
        line = _error_line(capsys, rl, ["grpo", f"checkpoint.save={out}"], "mindspeed-rl")
        assert f"checkpoint.save='{out}' {since}" in line
        # extract-features locks its cache directory (data.features).
        dit = tmp_path / "dit"
        dit.mkdir()
        (dit / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
        extract = ["extract-features", f"model.path={dit}", f"data.features={out}", f"data.files=[{dit}/x.json]"]
        line = _error_line(capsys, mm, extract, "mindspeed-mm")
        assert f"data.features='{out}' {since}" in line
    assert not out.exists()  # none of them wrote anything (the holder made the directory and removed it)
    # The converters lock next to their output directory (it is renamed into place at the end).
    converted = tmp_path / "converted"
    with RunLock(converted, beside=True):
        args = ["--load-dir", str(mm_model[0]), "--save-dir", str(converted)]
        convert = ["convert-ckpt", "--load-model-type", "hf", "--save-model-type", "mg", *args]
        line = _error_line(capsys, llm, convert, "mindspeed-llm")
        assert f"--save-dir='{converted}' {since}" in line
        convert = ["convert", "--load-format", "hf", "--save-format", "dcp", *args]
        line = _error_line(capsys, mm, convert, "mindspeed-mm")
        assert f"--save-dir='{converted}' {since}" in line
    assert not converted.exists() and not list(tmp_path.glob(".converted*"))
