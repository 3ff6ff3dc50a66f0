"""Faults injected into ``mindspeed-mm train`` (a tiny Qwen2.5-VL, 1 rank, 4 steps, a checkpoint every 2).

The multimodal trainer goes through the same shared machinery as the LLM trainer
(:mod:`mindspeed.checkpointing`), so these cases are few and cheap. One run directory lives
through a chain of real processes: SIGTERM after step 1 (saved although no interval step, exit
143), ``kill -9`` after step 2's shards are written but before ``complete.json``, then a run to
the end. After each: no process of the run is alive, no complete checkpoint was deleted, the
next run resumes from the newest complete checkpoint; at the end the losses, learning rates and
gradient norms equal the uninterrupted run's bit for bit. In this process: the first Ctrl-C
saves and exits 130; a damaged newest checkpoint (its shard truncated, the tracker deleted) is
skipped with one warning and the resumed steps equal the reference's; the time limit stops after
a step, exit 0; unusable checkpoints are one line and exit 2.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing import FAULT_ENV, STEP, TRACKER, list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

#: Steps trained again after each fault of the chain (docs/reliability.md's fault table).
MEASURED = {"SIGTERM": 0, "save.written": 1}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The in-process runs use one thread, as the spawned ones (OMP_NUM_THREADS=1): the same numerics."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _main(capsys: pytest.CaptureFixture, overrides: list[str], fault: str | None = None) -> tuple[int, str]:
    from mindspeed_mm.cli import main

    with pytest.MonkeyPatch.context() as patch:
        if fault is not None:
            patch.setenv(FAULT_ENV, fault)
        code = main(["--log-level", "WARNING", "train", *overrides])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def mm_reference(tmp_path_factory: pytest.TempPathFactory, mm_model: tuple[Path, Path]) -> Path:
    """The uninterrupted run (in this process, one thread): its save directory."""
    from mindspeed_mm.cli import main

    out = tmp_path_factory.mktemp("faults-mm-reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--log-level", "WARNING", "train", *harness.mm_recipe(*mm_model, out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert [r["step"] for r in harness.numerics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    return out


def _names(out: Path) -> list[str]:
    return [p.name for p in list_complete(out, STEP)]


def _stop_line(stderr: str, cause: str, step: int, steps: int, out: Path) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if "stopped by" in line]
    assert f"stopped by {cause} after step {step} of {steps}" in line, line
    assert f"checkpoint {out / f'step_{step:08d}'}; run the same command to resume" in line, line


def test_mm_signals_and_kills_resume_to_the_uninterrupted_run(
    tmp_path: Path, mm_model: tuple[Path, Path], mm_reference: Path
) -> None:
    out = tmp_path / "run"
    args = harness.mm_command(*harness.mm_recipe(*mm_model, out))
    lost = {}
    # SIGTERM at the end of step 1: step 1 is saved (not an interval step), exit 143.
    done = harness.run(args, fault="train.step_end@1=SIGTERM")
    assert done.returncode == 143 and done.resumed_step == 0, done.stderr[-3000:]
    _stop_line(done.stderr, "SIGTERM", 1, 4, out)
    assert _names(out) == ["step_00000001"]
    lost["SIGTERM"] = 0
    # kill -9 once step 2's shards are written, before complete.json: step 2 is trained again.
    done = harness.run(args, fault="save.written@2")
    assert done.returncode == -signal.SIGKILL and done.resumed_step == 1, done.stderr[-3000:]
    assert _names(out) == ["step_00000001"] and (out / "step_00000002.tmp").is_dir()
    lost["save.written"] = 2 - done.resumed_step
    # To the end: resumed from SIGTERM's checkpoint; the stale step_00000002.tmp is gone.
    done = harness.run(args)
    assert done.returncode == 0 and done.resumed_step == 1, done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(mm_reference / "metrics.jsonl")
    assert _names(out) == ["step_00000001", "step_00000002", "step_00000004"] and not list(out.glob("*.tmp"))
    assert lost == MEASURED, lost


def _copy(reference: Path, out: Path) -> Path:
    shutil.copytree(reference, out)
    (out / "metrics.jsonl").unlink()
    return out


def test_mm_damaged_newest_time_limit_and_unusable_checkpoints(
    tmp_path: Path, mm_model: tuple[Path, Path], mm_reference: Path, capsys: pytest.CaptureFixture
) -> None:
    model, data = mm_model
    full = harness.numerics(mm_reference / "metrics.jsonl")

    # The newest checkpoint's shard truncated and the tracker deleted: one warning, resumed from step 2.
    out = _copy(mm_reference, tmp_path / "damaged")
    (out / TRACKER).unlink()
    shard = next((out / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    code, err = _main(capsys, harness.mm_recipe(model, data, out))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    (warning,) = [line for line in err.splitlines() if "is damaged and skipped" in line]
    assert f"{out / 'step_00000004'} is damaged and skipped: file {shard.name} is truncated" in warning
    assert "resuming from step_00000002" in warning
    assert harness.numerics(out / "metrics.jsonl") == full[2:]
    assert _names(out) == ["step_00000002", "step_00000004"]

    # The first Ctrl-C after step 5 of 6: step 5 is saved (not an interval step), exit 130.
    out = _copy(mm_reference, tmp_path / "interrupted")
    # (More steps move the end of the cosine decay: the recipe's schedule wins from the resumed step.)
    longer = "checkpoint.override_scheduler=true"
    code, err = _main(capsys, [*harness.mm_recipe(model, data, out, steps=6), longer], fault="train.step_end@5=SIGINT")
    assert code == 130, err[-3000:]
    _stop_line(err, "SIGINT", 5, 6, out)
    assert _names(out) == ["step_00000002", "step_00000004", "step_00000005"]

    # The time limit: stops before step 5, with the step-4 checkpoint named; exit 0.
    out = _copy(mm_reference, tmp_path / "limited")
    code, err = _main(capsys, [*harness.mm_recipe(model, data, out, steps=5), longer, "train.exit_duration_mins=1e-6"])
    assert code == 0 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if "stopped by" in line]
    assert "stopped by the time limit (train.exit_duration_mins=1e-06) after step 4 of 5" in line
    assert f"checkpoint {out / 'step_00000004'}; run the same command to resume" in line

    # A save directory with checkpoints but no complete one: never trained over silently.
    out = tmp_path / "incomplete"
    shutil.copytree(mm_reference / "step_00000002", out / "step_00000002")
    (out / "step_00000002" / "complete.json").unlink()
    code, err = _main(capsys, harness.mm_recipe(model, data, out))
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-mm: error: ")]
    assert "holds checkpoints but none is complete (step_00000002: it has no complete.json" in line
    assert "checkpoint.resume=false" in line

    # Another model (LoRA adds parameters the checkpoint lacks; another class): one line each.
    code, err = _main(capsys, [*harness.mm_recipe(model, data, mm_reference), "lora.target_modules=[q_proj]"])
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-mm: error: ")]
    assert f"checkpoint {mm_reference / 'step_00000004'} holds no parameter " in line
    # A LoRA checkpoint holds the factors only (the base comes from model.path): the first it lacks is one.
    assert "q_proj.lora_A.default.weight" in line and "set checkpoint.save to a new directory" in line
    from mindspeed_mm.testing import write_tiny_model

    other = write_tiny_model(tmp_path / "qwen3_vl", "Qwen3VLForConditionalGeneration")
    code, err = _main(capsys, harness.mm_recipe(other, data, mm_reference))
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-mm: error: ")]
    assert "holds a Qwen2_5_VLForConditionalGeneration model" in line and "is a Qwen3VLForConditionalGeneration" in line
    assert _names(mm_reference) == [f"step_{s:08d}" for s in (2, 4)]  # the reference was not touched


def test_mm_full_disk_at_a_save_is_one_line_and_resumes(
    tmp_path: Path, mm_model: tuple[Path, Path], mm_reference: Path, capsys: pytest.CaptureFixture
) -> None:
    model, data = mm_model
    out = _copy(mm_reference, tmp_path / "full")
    shutil.rmtree(out / "step_00000004")
    (out / TRACKER).unlink()
    before = {p.name: p.read_bytes() for p in (out / "step_00000002").iterdir()}
    # The DCP save of step 4 runs out of space where it writes: exit 1, one line, no .tmp left.
    code, err = _main(capsys, harness.mm_recipe(model, data, out), fault="save.write@4=ENOSPC")
    assert code == 1 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-mm: error: ")]
    assert f"no space left on the file system of {out} to save step_00000004" in line, line
    assert f"the previous complete checkpoint {out / 'step_00000002'} is the resume point" in line, line
    assert not list(out.glob("*.tmp")) and _names(out) == ["step_00000002"]
    assert {p.name: p.read_bytes() for p in (out / "step_00000002").iterdir()} == before
    # Space again: the same command resumes from step 2 and trains the reference's steps 3-4.
    (out / "metrics.jsonl").unlink()
    code, err = _main(capsys, harness.mm_recipe(model, data, out))
    assert code == 0, err[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(mm_reference / "metrics.jsonl")[2:]


def test_mm_unreadable_images_stop_at_start_or_are_skipped_with_a_count(
    tmp_path: Path, mm_model: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    import io

    import numpy as np
    from PIL import Image

    model, data = mm_model
    shutil.copytree(data.parent, tmp_path / "data")
    data = tmp_path / "data" / data.name
    images = sorted((data.parent / "images").iterdir())
    images[0].write_bytes(b"\x89PNG\r\n\x1a\n not an image")  # sample 1: its header is damaged
    jpeg = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3)).astype(np.uint8)).save(jpeg, "JPEG")
    data_bytes = jpeg.getvalue()
    images[1].write_bytes(data_bytes[: len(data_bytes) * 2 // 3])  # sample 2: a sound header, cut data
    out = tmp_path / "run"
    code, err = _main(capsys, harness.mm_recipe(model, data, out, steps=2))
    assert code == 2 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-mm: error: ")]
    assert f"{data}:1: image {images[0]} cannot be read" in line and "data.skip_bad=true" in line, line
    assert not (out / "metrics.jsonl").exists(), "the run trained before the check"
    # data.skip_bad: sample 1 left out at start, sample 2 when it is decoded; each counted, the run goes on.
    code, err = _main(capsys, [*harness.mm_recipe(model, data, out, steps=4), "data.skip_bad=true"])
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "data.skip_bad: 1 of 8 samples of data.files skipped" in err, err[-3000:]
    assert f"data.skip_bad: skipping {data}:2: image {images[1]} cannot be read" in err, err[-3000:]
    assert [r["step"] for r in harness.numerics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_mm_changed_schedule_on_resume(
    tmp_path: Path, mm_model: tuple[Path, Path], mm_reference: Path, capsys: pytest.CaptureFixture
) -> None:
    """Resumed from step 2 with train.lr halved: refused (one line), or the recipe's schedule, or the checkpoint's."""
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.trainer.optim import lr_at

    model, data = mm_model
    full = harness.numerics(mm_reference / "metrics.jsonl")

    def step2(name: str) -> Path:
        out = tmp_path / name
        shutil.copytree(mm_reference / "step_00000002", out / "step_00000002")
        return out

    recipe = [*harness.mm_recipe(model, data, step2("refused")), "train.lr=5e-4"]
    code, err = _main(capsys, recipe)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-mm: error: ")]
    assert f"checkpoint {tmp_path / 'refused' / 'step_00000002'} was trained with another learning-rate" in line
    assert "train.lr: checkpoint 0.001 vs recipe 0.0005" in line and "decay's end" not in line
    assert "checkpoint.override_scheduler=true" in line and "checkpoint.use_checkpoint_scheduler=true" in line

    # The recipe wins: steps 3-4 train with the new recipe's schedule at those steps.
    out = step2("override")
    code, err = _main(
        capsys, [*harness.mm_recipe(model, data, out), "train.lr=5e-4", "checkpoint.override_scheduler=true"]
    )
    assert code == 0, err[-3000:]
    new = load_mm_config(None, [*harness.mm_recipe(model, data, out), "train.lr=5e-4"]).train
    got = harness.numerics(out / "metrics.jsonl")
    assert [r["lr"] for r in got] == [lr_at(new, 3), lr_at(new, 4)] and got[0]["lr"] != full[2]["lr"]

    # The checkpoint wins: steps 3-4 equal the uninterrupted run's, learning rates and losses bit for bit.
    out = step2("use")
    recipe = [*harness.mm_recipe(model, data, out), "train.lr=5e-4", "checkpoint.use_checkpoint_scheduler=true"]
    code, err = _main(capsys, recipe)
    assert code == 0, err[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == full[2:]
