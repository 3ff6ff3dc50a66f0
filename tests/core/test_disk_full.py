"""A full disk: the save and export guards, the one-line exit, and log sinks that warn once instead of a traceback per record."""

from __future__ import annotations

import argparse
import errno
import io
import logging
import os
from pathlib import Path

import pytest

from mindspeed.checkpointing import DiskFullError, export_guard, save_guard, write_marker
from mindspeed.checkpointing.faults import FAULT_ENV, child_write_fault, fault_point
from mindspeed.log import PACKAGE_LOGGERS, get_logger, open_run_log, setup_logging
from mindspeed.suite_cli import run_suite

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _complete(root: Path, step: int, size: int) -> Path:
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / "shard").write_bytes(b"x" * size)
    write_marker(path, step)
    return path


def test_save_guard_names_directory_sizes_and_resume_point_and_removes_tmp(tmp_path: Path) -> None:
    previous = _complete(tmp_path, 2, 3 * 2**20)
    tmp = tmp_path / "iter_0000004.tmp"
    tmp.mkdir()
    (tmp / "half").write_bytes(b"y" * 1000)
    # As megatron's writer reports it: the worker's OSError only as text inside a RuntimeError.
    with pytest.raises(DiskFullError) as info, save_guard(tmp_path, tmp_path / "iter_0000004"):
        raise RuntimeError(f"Worker failure: {NO_SPACE}")
    line = str(info.value)
    assert "\n" not in line and not tmp.exists(), line
    assert f"{tmp_path} to save iter_0000004: it needs about 3.0 MB (the size of iter_0000002)" in line, line
    assert f"the previous complete checkpoint {previous} is the resume point" in line, line
    assert "is free" in line and "run the same command to resume" in line
    # Other failures pass through unchanged, the .tmp of another rank is left to rank 0.
    tmp.mkdir()
    with pytest.raises(KeyError), save_guard(tmp_path, tmp_path / "iter_0000004"):
        raise KeyError("not a disk")
    with pytest.raises(DiskFullError), save_guard(tmp_path, tmp_path / "iter_0000004", remove_tmp=False):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert tmp.exists()


def test_export_guard_removes_staging(tmp_path: Path) -> None:
    staging = tmp_path / "hf.tmp"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"z" * 2**20)
    with pytest.raises(DiskFullError, match=r"to export hf: 1\.0 MB were written .* convert command"):
        with export_guard(tmp_path / "hf", staging):
            raise NO_SPACE
    assert not staging.exists()


def test_fault_point_raises_enospc_and_the_forked_writer_files_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    monkeypatch.setenv(FAULT_ENV, "save.write@4=ENOSPC")
    fault_point("save.write", 2)  # another step: nothing
    with pytest.raises(OSError) as info:
        fault_point("save.write", 4)
    assert info.value.errno == errno.ENOSPC
    real_open = builtins.open
    try:
        child_write_fault("save.write")  # what a forked writer of the step-4 save does
        with open(tmp_path / "f", "wb") as f, pytest.raises(OSError, match="No space left"):
            f.write(b"data")
        assert (tmp_path / "f").read_bytes() == b""  # reading still works
    finally:
        builtins.open = real_open


def test_run_suite_prints_one_line_and_exits_1_even_through_ray(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser(prog="suite")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command")
    error = DiskFullError("no space left on the file system of /x to save iter_0000004")

    def fail(args: argparse.Namespace) -> int:
        raise error

    sub.add_parser("train").set_defaults(func=fail)
    assert run_suite(parser, ["train"]) == 1
    assert capsys.readouterr().err == f"suite: error: {error}\n"
    ray_exceptions = pytest.importorskip("ray.exceptions")
    wrapped = ray_exceptions.RayTaskError("save", "Traceback (most recent call last):\n  ...", error)

    def fail_in_ray(args: argparse.Namespace) -> int:
        raise wrapped.as_instanceof_cause()

    sub.add_parser("grpo").set_defaults(func=fail_in_ray)
    assert run_suite(parser, ["grpo"]) == 1
    assert capsys.readouterr().err == f"suite: error: {error}\n"


class _FullFile(io.StringIO):
    def write(self, text: str) -> int:
        raise NO_SPACE


def test_a_run_log_on_a_full_disk_warns_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stream = io.StringIO()
    setup_logging("INFO", stream=stream)
    try:
        with open_run_log(tmp_path / "report.txt") as path:
            from mindspeed.log import _run_log

            assert path is not None
            _run_log.file.close()
            _run_log.file = _FullFile()
            for i in range(50):
                get_logger("mindspeed.x").info("record %d", i)
        lines = stream.getvalue().splitlines()
        assert len([line for line in lines if "cannot write the run log" in line]) == 1, lines
        assert "Logging error" not in stream.getvalue() + capsys.readouterr().err and len(lines) == 51, lines
    finally:
        for name in PACKAGE_LOGGERS:
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate, logger.level = True, logging.NOTSET
