"""The resume point, rotation and the stop agreement, on directories made by hand (no training)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mindspeed.checkpointing import (
    STEP,
    TRACKER,
    Preemption,
    checkpoint_dir,
    damage_of,
    find_resume,
    holds_checkpoints,
    list_complete,
    rotate,
    step_of,
    write_marker,
    write_tracker,
)

pytestmark = pytest.mark.faults


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = checkpoint_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 64)
    (path / "common.pt").write_bytes(b"y" * 8)
    if complete:
        write_marker(path, step)
        write_tracker(root, step)
    return path


def test_the_newest_complete_checkpoint_wins_over_the_tracker(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    two, four, six = (_checkpoint(tmp_path, s) for s in (2, 4, 6))
    assert find_resume(tmp_path).path == six and not find_resume(tmp_path).skipped
    write_tracker(tmp_path, 12)  # a tracker naming a step never written
    assert find_resume(tmp_path).path == six
    assert [p.name for p, _ in find_resume(tmp_path).skipped] == ["iter_0000012"]
    (six / "__0_0.distcp").write_bytes(b"x" * 10)  # truncated
    assert damage_of(six) == "file __0_0.distcp is truncated (10 of 64 bytes)"
    (tmp_path / TRACKER).unlink()
    (four / "common.pt").unlink()
    caplog.clear()
    with caplog.at_level("WARNING"):
        found = find_resume(tmp_path)
    assert found.path == two and [p for p, _ in found.skipped] == [six, four]
    assert len(caplog.records) == 2 and all("resuming from iter_0000002" in r.getMessage() for r in caplog.records)
    _checkpoint(tmp_path, 8, complete=False)  # a save killed before its marker
    assert find_resume(tmp_path).path == two and "no complete.json" in damage_of(tmp_path / "iter_0000008")
    assert holds_checkpoints(tmp_path) and not holds_checkpoints(tmp_path / "empty")


def test_rotation_counts_and_deletes_complete_checkpoints_only(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    damaged = _checkpoint(tmp_path, 8, complete=False)
    written = _checkpoint(tmp_path, 10)
    assert rotate(tmp_path, 2, written) == [checkpoint_dir(tmp_path, 2), checkpoint_dir(tmp_path, 4)]
    assert [p.name for p in list_complete(tmp_path)] == ["iter_0000006", "iter_0000010"] and damaged.is_dir()
    # A fresh run (checkpoint.resume=false) writing a lower step keeps it and the newest complete one.
    low = checkpoint_dir(tmp_path, 2)
    _checkpoint(tmp_path, 2)
    assert rotate(tmp_path, 1, low) == [checkpoint_dir(tmp_path, 6)]
    assert [p.name for p in list_complete(tmp_path)] == ["iter_0000002", "iter_0000010"]


def test_another_layout_sees_only_its_own_directories(tmp_path: Path) -> None:
    """The multimodal trainer's ``step_00000004``: found, rotated and named in its layout; ``iter_*`` are not its."""
    assert STEP.step_of("step_00000004") == 4 and STEP.step_of("iter_0000004") is None
    assert STEP.step_of("step_0000004") is None and step_of("step_00000004") is None
    for step in (2, 4, 6):
        path = checkpoint_dir(tmp_path, step, STEP)
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"x" * 8)
        write_marker(path, step)
    _checkpoint(tmp_path, 8)  # an iter_* directory: not a checkpoint of this layout
    found = find_resume(tmp_path, layout=STEP)
    assert found.path == tmp_path / "step_00000006" and found.step == 6
    assert rotate(tmp_path, 1, found.path, STEP) == [tmp_path / "step_00000002", tmp_path / "step_00000004"]
    assert [p.name for p in list_complete(tmp_path, STEP)] == ["step_00000006"]
    assert [p.name for p in list_complete(tmp_path)] == ["iter_0000008"]
    assert holds_checkpoints(tmp_path / "empty", STEP) is False


def test_time_limit_and_single_process_agreement() -> None:
    with Preemption(exit_duration_mins=None) as guard:
        assert guard.agree() is None
    with Preemption(exit_duration_mins=1e-6) as guard:
        time.sleep(0.01)
        stop = guard.agree()
    assert stop is not None and stop.reason == "time limit" and stop.exit_code == 0
