"""A full disk during a ``mindspeed-llm pretrain`` save: one line, exit 1, no ``.tmp`` left, and an exact resume.

Two ways to fill the disk: the fault point ``save.write@4=ENOSPC`` (megatron's forked checkpoint
writers fail their writes with ``ENOSPC``, so the error travels the way a real one does: writer
process, megatron's result queue, torch DCP's ``CheckpointException``), everywhere; and, where
the test may mount one (root), a real tmpfs too small for the run, which the run fills, is run
on again with not a byte left (no traceback per log record), then grown, after which the run
resumes and ends with the uninterrupted run's numbers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mindspeed.checkpointing import list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _one_line(done: harness.Finished, resume: Path) -> str:
    errors = done.lines("error:")
    assert done.returncode == 1 and len(errors) == 1, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr, done.stderr[-3000:]
    line = errors[0]
    assert "no space left" in line and f"{resume} is the resume point" in line and "B is free" in line, line
    return line


def _check_left(out: Path, resume: Path, before: dict[str, str]) -> None:
    assert not list(out.glob("*.tmp")), f"half-written save left: {list(out.glob('*.tmp'))}"
    assert list_complete(out)[-1] == resume
    assert _digest(resume) == before, "the previous complete checkpoint changed"


def test_enospc_in_the_forked_writers_is_one_line_and_resumes_exactly(
    tmp_path: Path, dataset: str, reference: Path
) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out))
    done = harness.run(args, fault=f"save.write@{2 * harness.INTERVAL}=ENOSPC")
    resume = out / "iter_0000002"
    line = _one_line(done, resume)
    assert f"{out} to save iter_0000004" in line and "the size of iter_0000002" in line, line
    _check_left(out, resume, _digest(resume))
    done = harness.run(args)
    assert done.returncode == 0 and done.resumed_step == 2, done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(reference / "metrics.jsonl")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=False).returncode == 0
    )


def _fill(path: Path) -> None:
    """Write ``path`` until the file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass


@pytest.fixture
def small_fs(tmp_path: Path):
    mount = tmp_path / "fs"
    if not _mount_tmpfs(mount, "600k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_file_system(small_fs: Path, dataset: str, reference: Path) -> None:
    out = small_fs / "run"
    args = harness.command(*harness.recipe(dataset, out))
    done = harness.run(args)
    resume = list_complete(out)[-1]
    _one_line(done, resume)
    before = _digest(resume)
    _check_left(out, resume, before)
    # Not a byte left: the next run resumes, cannot write its run log or metrics (one warning each, no
    # traceback per record), trains, and fails at the same save with one line again.
    filler = small_fs / "filler"
    _fill(filler)
    done = harness.run(args)
    _one_line(done, resume)
    warnings = done.lines("WARNING")
    assert any("cannot write the run log" in w for w in warnings), done.stderr[-3000:]
    assert len(warnings) <= 3, done.stderr[-3000:]  # the run log and metrics: one warning each
    _check_left(out, resume, before)
    # Space is freed: the run resumes from the same checkpoint and ends with the uninterrupted run's numbers.
    filler.unlink()
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_fs)], check=True)
    done = harness.run(args)
    assert done.returncode == 0 and done.resumed_step == int(resume.name.split("_")[1]), done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(reference / "metrics.jsonl")
