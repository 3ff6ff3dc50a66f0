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
