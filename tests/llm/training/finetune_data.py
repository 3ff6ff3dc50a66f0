"""Instruction and pairwise indexed datasets for the fine-tuning tests (random tokens, -100 prompts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mindspeed_llm.data.writer import build_pack, pack_lengths


def make_samples(num: int, seed: int, vocab: int, min_len: int = 6, max_len: int = 20) -> list[dict[str, np.ndarray]]:
    """Instruction samples: random tokens, the first 2..len/2 of them a prompt (label -100)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num):
        n = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(1, vocab, n).astype(np.int32)
        labels = ids.copy()
        labels[: int(rng.integers(2, n // 2 + 1))] = -100
        samples.append({"input_ids": ids, "attention_mask": np.ones(n, dtype=np.int32), "labels": labels})
    return samples


def _write(prefix: str, docs: dict[str, list[np.ndarray]]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    for key, arrays in docs.items():
        path = f"{prefix}_packed_{key}_document"
        builder = IndexedDatasetBuilder(f"{path}.bin", dtype=np.int32)
        for array in arrays:
            builder.add_document(torch.from_numpy(np.asarray(array, dtype=np.int32)), [len(array)])
        builder.finalize(f"{path}.idx")


def write_instruction(prefix: str, samples: list[dict[str, np.ndarray]], pack_to: int | None = None) -> str:
    """Write ``samples`` as preprocess-data does (one per document, or packed rows of ``pack_to``)."""
    docs = samples
    if pack_to is not None:
        docs = [
            build_pack([samples[i] for i in group], pack_to, 0)
            for group in pack_lengths([len(s["input_ids"]) for s in samples], pack_to)
        ]
    _write(prefix, {key: [d[key] for d in docs] for key in ("input_ids", "attention_mask", "labels")})
    return prefix


def write_pairwise(prefix: str, num: int, seed: int, vocab: int) -> str:
    """Preference pairs sharing a prompt (label -100) with different answers."""
    rng = np.random.default_rng(seed)
    docs: dict[str, list[np.ndarray]] = {
        k: [] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    }
    for _ in range(num):
        prompt = rng.integers(1, vocab, int(rng.integers(3, 8)))
        for side in ("chosen", "rejected"):
            answer = rng.integers(1, vocab, int(rng.integers(2, 9)))
            ids = np.concatenate([prompt, answer])
            labels = ids.copy()
            labels[: len(prompt)] = -100
            docs[f"{side}_input_ids"].append(ids)
            docs[f"{side}_labels"].append(labels)
    _write(prefix, docs)
    return prefix
