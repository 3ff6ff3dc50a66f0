"""Faults injected into real ``mindspeed-llm pretrain`` runs; each resumed run must match the uninterrupted one.

One run directory lives through a chain of faults, each run resuming where the last one
left off: ``kill -9`` at seeded points of training and of a checkpoint save (a forked writer
included), SIGTERM, Ctrl-C, a double Ctrl-C, then a run to the end. After every fault: no
process of the run is alive, no complete checkpoint was deleted, and the next run resumes
from the newest complete checkpoint (the progress lost is measured as the steps trained again).
At the end the whole run's losses, learning rates and gradient norms equal the reference run's
bit for bit. The damaged-checkpoint cases resume from copies of the reference's checkpoints.
"""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

import pytest

from mindspeed.checkpointing import LOCK_FILE, TRACKER, list_complete
from mindspeed.metrics.log import read_metrics
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

#: The seed of the fault points (training point and step, order and choice of the save points).
SEED = 13
_SAVE_POINTS = ("save.start", "save.written", "save.renamed", "save.tracker")
#: Save points after which the checkpoint being written is complete (renamed into place).
_SAVED = {"save.renamed", "save.tracker"}


#: Steps trained again after each fault of the seed-13 chain (docs/reliability.md's fault table).
MEASURED = {
    "train.step_start": 0,
    "save.start": 2,
    "save.writer": 2,
    "save.written": 2,
    "save.renamed": 0,
    "SIGTERM": 0,
    "SIGINT": 0,
    "SIGINT twice": 1,
}


def fault_chain(seed: int) -> list[str]:
    """The kill -9 points: one of training at a seeded step, then the forked writer and three seeded save points."""
    rng = random.Random(seed)
    saves = ["save.writer", *rng.sample(_SAVE_POINTS, 3)]
    rng.shuffle(saves)
    return [rng.choice(("train.step_start", "train.step_end")) + f"@{rng.randint(1, 3)}", *saves]


def _last_save(step: int) -> int:
    return step - step % harness.INTERVAL


def _no_traceback(done: harness.Finished) -> None:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_kills_signals_and_resumes_match_the_uninterrupted_run(tmp_path: Path, dataset: str, reference: Path) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out))
    resume = 0  # the step the next run must resume from
    lost = {}  # fault -> steps trained again
    for point in fault_chain(SEED):
        name = point.split("@")[0]
        if name.startswith("save."):
            point = f"{name}@{resume + harness.INTERVAL}"  # the next save this run makes
        before = set(list_complete(out))
        left = (out / LOCK_FILE).is_file()  # the run lock's file, left (unlocked) by a killed run
        done = harness.run(args, fault=point)
        assert done.returncode == -signal.SIGKILL, f"{point}: exit {done.returncode}\n{done.stderr[-3000:]}"
        # The lock a killed run left is no lock: taken over with one warning naming that run.
        assert len(done.lines("taking over the lock")) == int(left), done.stderr[-3000:]
        assert (out / LOCK_FILE).is_file()
        assert done.resumed_step == resume, f"{point}: resumed from {done.resumed_step}, expected {resume}"
        assert before <= set(list_complete(out)), f"{point}: a complete checkpoint was deleted"
        step = int(point.split("@")[1])
        reached = step - 1 if name == "train.step_start" else step
        # The checkpoint of the step a kill hit is there only once it was renamed into place.
        resume = step if name in _SAVED else _last_save(step - 1)
        lost[name] = reached - resume
    # Signals: the step finishes, a checkpoint is saved, one line says where, nothing is lost.
    for action, code in (("SIGTERM", 143), ("SIGINT", 130)):
        step = resume + 1
        done = harness.run(args, fault=f"train.step_end@{step}={action}")
        assert done.returncode == code and done.resumed_step == resume, done.stderr[-3000:]
        _no_traceback(done)
        assert not (out / LOCK_FILE).exists()  # released after saving
        (line,) = done.lines("stopped by")
        assert f"stopped by {action} after step {step} of {harness.STEPS}" in line
        assert f"checkpoint {out / f'iter_{step:07d}'}; run the same command to resume" in line
        resume, lost[action] = step, 0
    # A second Ctrl-C stops at once: no save, no traceback; the last complete checkpoint stays.
    done = harness.run(args, fault=f"train.step_end@{resume + 1}=SIGINTx2")
    assert done.returncode == 130 and done.resumed_step == resume, done.stderr[-3000:]
    _no_traceback(done)
    assert len(done.lines("interrupted twice")) == 1 and not done.lines("stopped by")
    lost["SIGINT twice"] = 1
    left = (out / LOCK_FILE).is_file()
    done = harness.run(args)
    assert done.returncode == 0 and done.resumed_step == resume, done.stderr[-3000:]
    assert len(done.lines("taking over the lock")) == int(left) and not (out / LOCK_FILE).exists()
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(reference / "metrics.jsonl")
    assert lost == MEASURED, lost  # the fault table of docs/reliability.md
    assert {f"iter_{s:07d}" for s in range(2, harness.STEPS + 1, 2)} <= {p.name for p in list_complete(out)}
    assert not list(out.glob("iter_*.tmp")) and not list(out.glob("*.deleting"))


def _copy(reference: Path, out: Path) -> Path:
    shutil.copytree(reference, out)
    (out / "metrics.jsonl").unlink()
    return out


@pytest.mark.parametrize("damage", ["tracker_shard_truncated", "directory"])
def test_damaged_newest_checkpoints_are_skipped_with_one_warning_each(
    tmp_path: Path, dataset: str, reference: Path, damage: str
) -> None:
    out = _copy(reference, tmp_path / "run")
    newest, previous = out / "iter_0000010", out / "iter_0000008"
    if damage == "tracker_shard_truncated":  # the tracker deleted, a shard of 10 deleted, one of 8 truncated
        (out / TRACKER).unlink()
        next(newest.glob("*.distcp")).unlink()
        shard = max(previous.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        expected, skipped = 6, [newest, previous]
    else:  # the newest directory deleted; the tracker still names it
        shutil.rmtree(newest)
        expected, skipped = 8, [newest]
    intact = set(list_complete(out))
    done = harness.run(harness.command(*harness.recipe(dataset, out)))
    assert done.returncode == 0 and done.resumed_step == expected, done.stderr[-3000:]
    warnings = done.lines("is damaged and skipped")
    assert len(warnings) == len(skipped)
    assert all(
        str(path) in line and f"resuming from iter_{expected:07d}" in line for path, line in zip(skipped, warnings)
    )
    assert intact <= set(list_complete(out))
    full = harness.numerics(reference / "metrics.jsonl")
    assert harness.numerics(out / "metrics.jsonl") == full[expected:]


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="the launcher's interrupt signal")
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path, dataset: str) -> None:
    import psutil

    out = tmp_path / "run"
    proc = harness.start(harness.command(*harness.recipe(dataset, out, steps=100000), nproc=2))
    harness.wait_for_step(out, 2, proc)
    ranks = sorted(
        (p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())),
        key=lambda p: (p.create_time(), p.pid),
    )
    assert len(ranks) == 2
    ranks[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns it from the per-step all-reduce
    done = harness.finish(proc)
    assert done.returncode == 143, done.stderr[-3000:]
    _no_traceback(done)
    (line,) = done.lines("stopped by SIGTERM")
    last = max(r["step"] for r in read_metrics(out / "metrics.jsonl"))
    assert f"after step {last} of 100000" in line
    assert list_complete(out)[-1].name == f"iter_{last:07d}"
