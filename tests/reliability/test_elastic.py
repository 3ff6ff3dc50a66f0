"""Elastic restart: a rank killed mid-run makes the group restart and resume from the newest complete checkpoint.

The tiny two-rank ``mindspeed-llm pretrain`` run (docs/reliability.md) with rank 1 killed by
``kill -9`` at the start of a step (``MINDSPEED_FAULT=train.step_start@K``, ``MINDSPEED_FAULT_RANK=1``;
a fault fires on the first attempt only). One save directory lives through a chain: without
``--max-restarts`` the run fails with one line; with ``--max-restarts 1`` the launcher restarts both
ranks, they resume from the newest complete checkpoint and finish. The whole run's losses, learning
rates and gradient norms equal the uninterrupted two-rank run's bit for bit; so do plain
``torchrun --max-restarts 1``'s.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from mindspeed.checkpointing import LOCK_FILE, list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]


def _resumed(done: harness.Finished) -> list[int]:
    """The steps every attempt of the run resumed from, in order."""
    return [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", done.stderr)]


def _seconds(first: str, then: str) -> int:
    """Seconds between two log lines' ``HH:MM:SS`` stamps."""
    h0, m0, s0, h1, m1, s1 = (
        int(x) for line in (first, then) for x in re.search(r"(\d\d):(\d\d):(\d\d)", line).groups()
    )
    return (h1 - h0) * 3600 + (m1 - m0) * 60 + s1 - s0


def test_our_launcher_restarts_a_killed_rank_and_matches_the_uninterrupted_run(
    tmp_path: Path, dataset: str, two_ranks: Path
) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out), nproc=2)
    # Without --max-restarts: rank 1 killed at the start of step 3 fails the run with one line, the lock released.
    done = harness.run(args, fault="train.step_start@3", rank=1)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not done.lines("restart 1"), done.stderr[-3000:]
    (line,) = done.lines("error:")
    assert line == (
        "mindspeed-llm: error: rank 1 was killed by SIGKILL; the same command resumes from the newest complete "
        "checkpoint"
    )
    assert max(p.name for p in list_complete(out)) == "iter_0000002" and not (out / LOCK_FILE).exists()

    # --max-restarts 1: resumed from 2, rank 1 killed at the start of step 7, both ranks restarted from 6.
    done = harness.run([*args, "--max-restarts", "1"], fault="train.step_start@7", rank=1)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.lines("restart 1 of 1")
    assert line.endswith(
        "rank 1 was killed by SIGKILL: restart 1 of 1 (--max-restarts 1), the ranks resume from the newest "
        "complete checkpoint"
    )
    assert _resumed(done) == [2, 6], done.stderr[-3000:]
    print(f"restarted group resumed {_seconds(line, done.lines('at step 6')[0])} s after the restart line")
    assert "Traceback" not in done.stderr and not done.lines("error:"), done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(two_ranks / "metrics.jsonl")
    assert {f"iter_{s:07d}" for s in range(2, harness.STEPS + 1, 2)} <= {p.name for p in list_complete(out)}
    assert not (out / LOCK_FILE).exists()


def test_a_killed_rank_under_torchrun_max_restarts_resumes_and_matches(
    tmp_path: Path, dataset: str, two_ranks: Path
) -> None:
    # torchrun --max-restarts 1 --nproc-per-node 2 $(which mindspeed-llm) pretrain ...: torchrun restarts the group
    # (TORCHELASTIC_RESTART_COUNT=1), which resumes from the newest complete checkpoint as any new run does.
    out = tmp_path / "run"
    exe, *rest = harness.command(*harness.recipe(dataset, out))
    torchrun = [str(Path(exe).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    done = harness.run([*torchrun, "--monitor-interval", "0.5", exe, *rest], fault="train.step_start@5", rank=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _resumed(done) == [4], done.stderr[-3000:]
    assert len(done.lines(f"failed (exitcode: -{signal.SIGKILL.value}) local_rank: 1")) == 1, done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(two_ranks / "metrics.jsonl")
    assert {f"iter_{s:07d}" for s in range(2, harness.STEPS + 1, 2)} <= {p.name for p in list_complete(out)}
