"""Tiny Hugging Face checkpoints for the rollout-engine tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, and CI's 2 cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """``old`` and ``new``: two qwen3 checkpoints that differ only in their weights (seeds 0 and 7)."""
    root = tmp_path_factory.mktemp("rollout")
    dirs = {"old": root / "old", "new": root / "new"}
    save_tiny_checkpoint("qwen3", dirs["old"], seed=0)
    save_tiny_checkpoint("qwen3", dirs["new"], seed=7)
    return dirs
