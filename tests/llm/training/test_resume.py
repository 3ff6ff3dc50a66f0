"""Exact resume: a run killed with SIGKILL while saving resumes to the same losses, bit for bit.

Three real ``mindspeed-llm pretrain --nproc-per-node 2`` processes (DP2 with the distributed
optimizer, 6 steps, checkpoints every 3 steps, keep the last one, evaluation every 3 steps):

1. the uninterrupted run;
2. the same command, killed with ``kill -9`` while it writes the step-6 checkpoint (its
   ``iter_0000006.tmp`` directory exists): the kill hits the launcher, its ranks must die with
   it, and the step-3 checkpoint must stay the one the tracker names;
3. the same command again: it resumes from step 3 (model, distributed-optimizer state, LR
   schedule, RNG, data position) and finishes.

Every logged record of run 3's ``metrics.jsonl`` (losses, learning rates, gradient norms,
validation losses) must equal run 1's exactly, and only the last checkpoint may remain;
TensorBoard's scalars of both runs are the same curve and both drew ``loss.png``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mindspeed.metrics.log import read_metrics
from mindspeed_llm.training.checkpoint import TRACKER, list_checkpoints
from tests.llm.training.datasets import write_indexed_dataset

#: Fields that measure time, not numerics.
TIMING = {"step_time_s", "tokens_per_s", "mfu"}


def _command(prefix: str, out: Path) -> list[str]:
    return [
        str(Path(sys.executable).parent / "mindspeed-llm"),
        "--log-level",
        "WARNING",
        "pretrain",
        "--nproc-per-node",
        "2",
        f"data.prefixes=[{prefix}]",
        "data.seq_length=32",
        "data.split=90,10,0",
        "model.vocab_size=128",
        "model.num_layers=2",
        "model.num_query_groups=2",
        "train.steps=6",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.lr=3e-3",
        "train.lr_warmup_steps=2",
        "train.lr_warmup_init=1e-3",
        "parallel.distributed_optimizer=true",
        "eval.interval=3",
        "eval.iters=1",
        f"checkpoint.save={out}",
        "checkpoint.interval=3",
        "checkpoint.keep_last=1",
        "logging.progress=false",
    ]


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _numerics(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find leftover processes")
def test_kill_during_save_then_resume_is_bit_identical(tmp_path: Path) -> None:
    prefix = write_indexed_dataset(tmp_path / "data" / "d", 200, seed=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    uninterrupted, resumed = tmp_path / "full", tmp_path / "resumed"
    done = subprocess.run(_command(prefix, uninterrupted), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    marker = f"MINDSPEED_RESUME_TEST={uuid.uuid4().hex}"
    key, value = marker.split("=")
    killed = subprocess.Popen(
        _command(prefix, resumed), env={**env, key: value}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    saving = resumed / "iter_0000006.tmp"
    deadline = time.monotonic() + 600
    while not saving.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saving.exists(), "the run ended before it started the step-6 checkpoint: " + killed.stderr.read()[-3000:]
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    assert (resumed / TRACKER).read_text().strip() == "3", "the tracker moved past the checkpoint being written"
    assert [p.name for p in list_checkpoints(resumed)] == ["iter_0000003"]
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(marker), "ranks outlived their killed launcher"
    partial = read_metrics(resumed / "metrics.jsonl")
    assert max(r["step"] for r in partial) == 6, "the kill came before step 6 was logged"

    done = subprocess.run(_command(prefix, resumed), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected, got = read_metrics(uninterrupted / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in expected] == [
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("eval", 3),
        ("train", 4),
        ("train", 5),
        ("train", 6),
        ("eval", 6),
    ]
    assert _numerics(got) == _numerics(expected)
    assert expected[0]["lr"] != expected[2]["lr"] and expected[-2]["loss"] < expected[0]["loss"]
    assert [p.name for p in list_checkpoints(resumed)] == ["iter_0000006"]
    assert not list(resumed.glob("*.tmp")) and not list(resumed.glob("*.deleting"))
    # TensorBoard shows one continuous run too (the killed run's steps 4-6 are purged), and the
    # loss curve of the whole run is drawn.
    for run in (uninterrupted, resumed):
        for kind in ("train", "eval"):
            steps, values = _scalars(run / "tensorboard", f"{kind}/loss")
            assert steps == [r["step"] for r in expected if r["kind"] == kind]
            assert values == pytest.approx([r["loss"] for r in expected if r["kind"] == kind], rel=1e-6)
        assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _scalars(directory: Path, tag: str) -> tuple[list[int], list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    scalars = events.Scalars(tag)
    return [event.step for event in scalars], [event.value for event in scalars]
