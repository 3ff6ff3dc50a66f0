"""``checkpoint.async_save``: checkpoints written in the background keep every guarantee of a synchronous save.

One save directory lives through a chain of tiny ``mindspeed-llm pretrain`` runs with
``checkpoint.async_save=true``: ``kill -9`` while the background writer of step 4's checkpoint is
writing (the forked writer kills its trainer: the save in flight must not become the resume point),
SIGTERM after step 7 (the stop waits for the save in flight and completes its own), then a run to
the end. Each run resumes from the newest complete checkpoint, and the whole run's losses, learning
rates and gradient norms equal the synchronous reference run's bit for bit (so every staged
checkpoint held the state of its step, not of a later one).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mindspeed.checkpointing import LOCK_FILE, list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]


def test_async_saves_resume_bit_identically_and_a_save_in_flight_is_never_the_resume_point(
    tmp_path: Path, dataset: str, reference: Path
) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out), "checkpoint.async_save=true")

    done = harness.run(args, fault="save.writer@4")  # kill -9 during the background write of step 4
    assert done.returncode == -signal.SIGKILL and done.resumed_step == 0, done.stderr[-3000:]
    assert [p.name for p in list_complete(out)] == ["iter_0000002"]
    assert (out / "iter_0000004.tmp").is_dir() and not (out / "iter_0000004").exists()

    done = harness.run(args, fault="train.step_end@7=SIGTERM")
    assert done.returncode == 143 and done.resumed_step == 2, done.stderr[-3000:]
    (line,) = done.lines("stopped by")
    assert "stopped by SIGTERM after step 7 of 10" in line and str(out / "iter_0000007") in line
    assert {"iter_0000004", "iter_0000006", "iter_0000007"} <= {p.name for p in list_complete(out)}
    assert not list(out.glob("iter_*.tmp")) and not (out / LOCK_FILE).exists()
    assert len(done.lines("written in the background")) == 3  # 4, 6 and the stop's 7

    done = harness.run(args)
    assert done.returncode == 0 and done.resumed_step == 7, done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(reference / "metrics.jsonl")
    assert {f"iter_{s:07d}" for s in range(2, harness.STEPS + 1, 2)} <= {p.name for p in list_complete(out)}
    assert not list(out.glob("iter_*.tmp"))
