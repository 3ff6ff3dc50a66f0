"""Shared fixtures: the demo tokenizer in a private cache, a runner, and a reader of the output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mindspeed_llm.data import PreprocessConfig, preprocess_data
from mindspeed_llm.tokenizer import demo_tokenizer_path


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """A cache root holding the demo tokenizer; ``"demo"`` resolves here during these tests."""
    root = tmp_path_factory.mktemp("mindspeed-cache")
    demo_tokenizer_path(cache_dir=root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINDSPEED_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="session")
def tok_dir(demo_cache) -> Path:
    """The demo tokenizer directory."""
    return demo_tokenizer_path(cache_dir=demo_cache)


@pytest.fixture(scope="session")
def tok(tok_dir):
    """The demo tokenizer, loaded the way a user would load it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """One JSON value per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_dataset(prefix: str) -> list[np.ndarray]:
    """Every sequence of an indexed dataset, read with megatron-core's own reader."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    assert list(dataset.document_indices) == list(range(len(dataset) + 1)), "one sequence per document"
    # Copies: the arrays are views of a memory map that closes with the dataset.
    return [np.array(dataset[i], copy=True) for i in range(len(dataset))]


@pytest.fixture
def run(tmp_path, tok_dir):
    """``run(input, **flags) -> (report, output_prefix)`` with the demo tokenizer."""

    def _run(input_path: Path, **kwargs):
        prefix = str(tmp_path / "out" / kwargs.pop("name", "data"))
        config = PreprocessConfig(
            input=str(input_path), tokenizer_name_or_path=str(tok_dir), output_prefix=prefix, **kwargs
        )
        return preprocess_data(config), prefix

    return _run
