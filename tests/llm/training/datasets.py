"""Indexed datasets for the trainer's tests, written with megatron-core's own builder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 128


def write_indexed_dataset(prefix: Path, num_docs: int, seed: int, vocab: int = VOCAB) -> str:
    """Documents of 20-80 tokens from a learnable toy language; returns the prefix as a string.

    Each token is mostly ``(5 * previous + 1) mod vocab``, sometimes random, so a model can
    learn it and losses fall; every document ends with the end-of-document token 0.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(num_docs):
        length = int(rng.integers(20, 80))
        doc = [int(rng.integers(1, vocab))]
        for _ in range(length - 2):
            doc.append((5 * doc[-1] + 1) % (vocab - 1) + 1 if rng.random() > 0.15 else int(rng.integers(1, vocab)))
        doc.append(0)
        builder.add_document(torch.tensor(doc, dtype=torch.int32), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)
