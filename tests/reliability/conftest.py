"""Shared by the fault-injection tests: one tiny data set and one uninterrupted reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.llm.training.datasets import write_indexed_dataset
from tests.reliability import harness


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The prefix of a small indexed data set (200 documents)."""
    return write_indexed_dataset(tmp_path_factory.mktemp("faults-data") / "d", 200, seed=3)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, dataset: str) -> Path:
    """The uninterrupted run every fault is compared with: its save directory (checkpoints and metrics)."""
    out = tmp_path_factory.mktemp("faults-reference") / "run"
    done = harness.run(harness.command(*harness.recipe(dataset, out)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in harness.numerics(out / "metrics.jsonl")] == list(range(1, harness.STEPS + 1))
    return out


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, dataset: str) -> Path:
    """The uninterrupted run of the tiny recipe on two ranks (``--nproc-per-node 2``): its save directory."""
    out = tmp_path_factory.mktemp("two-ranks") / "run"
    done = harness.run(harness.command(*harness.recipe(dataset, out), nproc=2))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def mm_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny Qwen2.5-VL directory, an 8-sample image-question data.jsonl)."""
    from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model

    root = tmp_path_factory.mktemp("faults-mm")
    return write_tiny_model(root / "qwen2_5_vl"), write_tiny_dataset(root / "data", num_samples=8)
