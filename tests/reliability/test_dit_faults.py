"""Faults injected into ``mindspeed-mm train`` of a diffusion transformer (a tiny Wan on a feature cache, 1 rank).

The DiT task trains through the same loop and checkpoints as the VLM task (:mod:`mindspeed.checkpointing`),
but its state differs: EMA-AdamW's moving averages, the bucketed data order, and per-microbatch
generators for the timesteps, the noise and the text dropout. One run directory lives through a chain of
real processes: SIGTERM after step 1 (saved although no interval step, exit 143), ``kill -9`` after step
2's shards are written but before ``complete.json`` (step 2 is trained again), then a run to the end.
The resumed run's losses, gradient norms, learning rates and token counts equal the uninterrupted run's
bit for bit, and so do its last checkpoint (weights, Adam moments, moving averages) and its diffusers
export. In this process: a run resumed from a copy of the reference's step-2 checkpoint (its newer ones
removed) trains steps 3-4 to the same numbers and weights.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing import STEP, TRACKER, list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

STEPS = 4


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The in-process runs use one thread, as the spawned ones (OMP_NUM_THREADS=1): the same numerics."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny Wan transformer directory, a feature cache of 8 samples for it)."""
    from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run

    return write_tiny_dit_run(tmp_path_factory.mktemp("faults-dit") / "wan", "WanTransformer3DModel")


def _train(overrides: list[str]) -> int:
    from mindspeed_mm.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["--log-level", "WARNING", "train", *overrides])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dit_reference(tmp_path_factory: pytest.TempPathFactory, dit_run: tuple[Path, Path]) -> Path:
    """The uninterrupted run (in this process, one thread): its save directory."""
    out = tmp_path_factory.mktemp("faults-dit-reference") / "run"
    assert _train(harness.dit_recipe(*dit_run, out)) == 0
    assert [r["step"] for r in harness.numerics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    return out


def _names(out: Path) -> list[str]:
    return [p.name for p in list_complete(out, STEP)]


def _checkpoint(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model and optimizer tensors (EMA-AdamW's moments and averages), by flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = tmp / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, file)
    state = torch.load(file, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", {"model": state["model"], "optim": state["optim"]})
    return flat


def _exported(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((out / "hf").glob("*.safetensors"))
    assert files, f"no diffusers export in {out / 'hf'}"
    return {k: v for f in files for k, v in load_file(f).items()}


def _assert_same_run(out: Path, reference: Path, tmp: Path) -> None:
    """Numerics, the last checkpoint (weights, moments, averages) and the export equal the reference's bit for bit."""
    ours, theirs = harness.numerics(out / "metrics.jsonl"), harness.numerics(reference / "metrics.jsonl")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    assert ours == theirs
    last = f"step_{STEPS:08d}"
    got, expected = _checkpoint(out / last, tmp), _checkpoint(reference / last, tmp)
    assert set(got) == set(expected) and any(k.endswith(".ema") for k in got), sorted(got)[:8]
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, different[:5]
    got, expected = _exported(out), _exported(reference)
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def _stop_line(stderr: str, cause: str, step: int, out: Path) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if "stopped by" in line]
    assert f"stopped by {cause} after step {step} of {STEPS}" in line, line
    assert f"checkpoint {out / f'step_{step:08d}'}; run the same command to resume" in line, line


def test_dit_signals_and_kills_resume_to_the_uninterrupted_run(
    tmp_path: Path, dit_run: tuple[Path, Path], dit_reference: Path
) -> None:
    out = tmp_path / "run"
    args = harness.mm_command(*harness.dit_recipe(*dit_run, out))
    # SIGTERM at the end of step 1: step 1 is saved (not an interval step), exit 143, no export.
    done = harness.run(args, fault="train.step_end@1=SIGTERM")
    assert done.returncode == 143 and done.resumed_step == 0, done.stderr[-3000:]
    _stop_line(done.stderr, "SIGTERM", 1, out)
    assert _names(out) == ["step_00000001"] and not (out / "hf").exists()
    # kill -9 once step 2's shards are written, before complete.json: step 2 is trained again.
    done = harness.run(args, fault="save.written@2")
    assert done.returncode == -signal.SIGKILL and done.resumed_step == 1, done.stderr[-3000:]
    assert _names(out) == ["step_00000001"] and (out / "step_00000002.tmp").is_dir()
    # To the end: resumed from SIGTERM's checkpoint; the stale step_00000002.tmp is gone.
    done = harness.run(args)
    assert done.returncode == 0 and done.resumed_step == 1, done.stderr[-3000:]
    assert _names(out) == ["step_00000001", "step_00000002", "step_00000004"] and not list(out.glob("*.tmp"))
    _assert_same_run(out, dit_reference, tmp_path)


def test_dit_resume_from_an_interval_checkpoint(
    tmp_path: Path, dit_run: tuple[Path, Path], dit_reference: Path
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(dit_reference / "step_00000002", out / "step_00000002")
    assert (dit_reference / TRACKER).is_file() and not (out / TRACKER).exists()  # found without the tracker
    shutil.copy(dit_reference / "metrics.jsonl", out / "metrics.jsonl")
    assert _train(harness.dit_recipe(*dit_run, out)) == 0
    _assert_same_run(out, dit_reference, tmp_path)
