"""Damaged data stops ``mindspeed-llm pretrain`` before its first step, with one line naming the file and the sequence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mindspeed_llm.training.data_check import HEADER_BYTES
from tests.reliability import harness

pytestmark = pytest.mark.faults


def _copy(dataset: str, root: Path) -> str:
    root.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(dataset + ext, root / f"d{ext}")
    return str(root / "d")


def test_damaged_idx_and_truncated_bin_stop_the_run_at_start(tmp_path: Path, dataset: str) -> None:
    overwritten = _copy(dataset, tmp_path / "overwritten")
    with open(overwritten + ".idx", "r+b") as f:  # 64 bytes of the sequence pointers (the damage)
        f.seek(HEADER_BYTES + 4 * 200 + 8 * 50)
        f.write(bytes(range(100, 164)))
    truncated = _copy(dataset, tmp_path / "truncated")
    with open(truncated + ".bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1000)
    for prefix, words in (
        (overwritten, f"{overwritten}.idx: sequence 50 starts"),
        (truncated, f"{truncated}.bin is truncated"),
    ):
        out = Path(prefix).parent / "run"
        done = harness.run(harness.command(*harness.recipe(prefix, out)))
        errors = done.lines("error:")
        assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
        assert words in errors[0] and "preprocess-data" in errors[0], errors[0]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert not (out / "metrics.jsonl").exists() and not list(out.glob("iter_*")), "the run trained"
