"""Running real ``mindspeed-llm pretrain`` (and ``mindspeed-mm train``) processes and checking what they leave behind.

Every run is a subprocess in a session of its own (its process group: the trainer, its ranks,
their forked checkpoint writers), so that "no process of the run is left alive" is a look at
that group in /proc. The recipe is the tiniest model (one layer, hidden 16) for 10 steps with a
checkpoint every 2 steps: a run costs about as much as starting Python with torch and megatron.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mindspeed.metrics.log import read_metrics

STEPS = 10
INTERVAL = 2
#: Fields that measure time, not numerics.
TIMING = {"step_time_s", "tokens_per_s", "mfu"}
_RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


def recipe(prefix: str, out: Path, steps: int = STEPS) -> list[str]:
    """The overrides of the tiny run: 1 layer, hidden 16, ``steps`` steps, a checkpoint every 2."""
    return [
        f"data.prefixes=[{prefix}]",
        "data.seq_length=16",
        "data.split=100,0,0",
        "model.vocab_size=128",
        "model.num_layers=1",
        "model.hidden_size=16",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        f"train.steps={steps}",
        "train.micro_batch_size=2",
        "train.lr=3e-3",
        "eval.interval=null",
        "eval.at_end=false",
        f"checkpoint.save={out}",
        f"checkpoint.interval={INTERVAL}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
    ]


def command(*overrides: str, nproc: int = 1) -> list[str]:
    """``mindspeed-llm --log-level INFO pretrain --nproc-per-node N overrides...``."""
    exe = str(Path(sys.executable).parent / "mindspeed-llm")
    return [exe, "--log-level", "INFO", "pretrain", "--nproc-per-node", str(nproc), *overrides]


def mm_recipe(model: Path, data: Path, out: Path, steps: int = 4) -> list[str]:
    """The overrides of the tiny multimodal run: a tiny Qwen2.5-VL, ``steps`` steps of 2 samples, a checkpoint every 2."""
    return [
        f"model.path={model}",
        f"data.files=[{data}]",
        f"train.steps={steps}",
        "train.micro_batch_size=2",
        "train.precision=fp32",
        "train.lr=1e-3",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
        f"checkpoint.save={out}",
        f"checkpoint.interval={INTERVAL}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
    ]


def dit_recipe(model: Path, features: Path, out: Path, steps: int = 4) -> list[str]:
    """The overrides of the tiny diffusion-transformer run: a tiny Wan on a feature cache, ``steps`` steps of
    2 microbatches of 2 (shuffled buckets, logit-normal timesteps, text dropout, EMA-AdamW), a checkpoint
    every 2, the averages exported to ``out/hf``."""
    return [
        f"model.path={model}",
        f"data.features={features}",
        "data.text_len=8",
        f"train.steps={steps}",
        "train.micro_batch_size=2",
        "train.gradient_accumulation_steps=2",
        "train.precision=fp32",
        "train.lr=1e-3",
        "train.ema=0.9",
        "diffusion.shift=3.0",
        "diffusion.timestep_sampling=logit_normal",
        "diffusion.text_dropout=0.3",
        f"checkpoint.save={out}",
        f"checkpoint.interval={INTERVAL}",
        f"checkpoint.save_hf={out / 'hf'}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
    ]


def mm_command(*overrides: str) -> list[str]:
    """``mindspeed-mm --log-level INFO train overrides...``."""
    return [str(Path(sys.executable).parent / "mindspeed-mm"), "--log-level", "INFO", "train", *overrides]


@dataclass
class Finished:
    """A finished run: exit status, standard error, and the step it resumed from (0: a fresh start)."""

    returncode: int
    stderr: str
    resumed_step: int

    def lines(self, pattern: str) -> list[str]:
        """The lines of standard error that contain ``pattern``."""
        return [line for line in self.stderr.splitlines() if pattern in line]


def env(fault: str | None = None, rank: int | None = None) -> dict[str, str]:
    """The environment of a run: one thread, and ``MINDSPEED_FAULT`` when a fault point is armed (in the processes
    of global rank ``rank`` only when given: ``MINDSPEED_FAULT_RANK``)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_FAULT", "TORCHELASTIC_"))}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if fault is not None:
        out["MINDSPEED_FAULT"] = fault
    if rank is not None:
        out["MINDSPEED_FAULT_RANK"] = str(rank)
    return out


def start(args: list[str], fault: str | None = None, rank: int | None = None) -> subprocess.Popen:
    """Start a run in a new session (its own process group)."""
    return subprocess.Popen(
        args, env=env(fault, rank), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = 300.0) -> Finished:
    """Wait for ``proc``; check that no process of its group outlives it."""
    _, stderr = proc.communicate(timeout=timeout)
    assert_no_leftovers(proc.pid)
    match = _RESUMED.findall(stderr)
    return Finished(proc.returncode, stderr, int(match[-1][1]) if match else 0)


def run(args: list[str], fault: str | None = None, timeout: float = 300.0, rank: int | None = None) -> Finished:
    """Run to the end (or to its fault point) and check for leftovers."""
    return finish(start(args, fault, rank), timeout)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies excluded), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def assert_no_leftovers(pgid: int, wait_s: float = 15.0) -> None:
    """Every process of the run's group is gone (within ``wait_s``: the kernel delivers PDEATHSIG)."""
    deadline = time.monotonic() + wait_s
    while (alive := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # clean up before failing, so that one failure does not slow the rest
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes {alive} of the run outlived it"


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Block until ``out/metrics.jsonl`` holds a train record of ``step`` (or the run ended)."""
    deadline = time.monotonic() + timeout
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file() and any(r.get("step", 0) >= step for r in read_metrics(path)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never logged step {step} (exit {proc.poll()})")


def numerics(path: Path) -> list[dict]:
    """The train records of a metrics file without the timing fields, in step order."""
    records = [r for r in read_metrics(path) if r["kind"] == "train"]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]
