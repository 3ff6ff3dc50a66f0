"""Tiny Hugging Face checkpoints of every bridged family, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_llm.testing.tiny_models import TINY_CONFIGS, save_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> directory of its tiny checkpoint (sharded safetensors, config, tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-hf")
    out = {}
    for family in TINY_CONFIGS:
        out[family] = root / family
        save_tiny_checkpoint(family, out[family])
    return out
