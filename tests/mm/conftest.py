"""A tiny Qwen2.5-VL directory and a small image-question data set, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory, data.jsonl): 8 samples, every 4th without an image, image sizes varying."""
    root = tmp_path_factory.mktemp("tiny-vlm")
    return write_tiny_model(root / "qwen2_5_vl"), write_tiny_dataset(root / "data", num_samples=8)


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory, tiny_vlm) -> tuple[Path, Path]:
    """(Qwen3-VL model directory, the same data.jsonl)."""
    root = tmp_path_factory.mktemp("tiny-qwen3-vl")
    return write_tiny_model(root / "qwen3_vl", "Qwen3VLForConditionalGeneration"), tiny_vlm[1]


@pytest.fixture(scope="session")
def tiny_internvl(tmp_path_factory, tiny_vlm) -> tuple[Path, Path]:
    """(InternVL model directory, the same data.jsonl)."""
    root = tmp_path_factory.mktemp("tiny-internvl")
    return write_tiny_model(root / "internvl", "InternVLForConditionalGeneration"), tiny_vlm[1]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models' ops are far faster without OpenMP contention on a shared 2-core host."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
