"""Megatron indexed datasets written atomically, and sample packing.

The files are written by megatron-core's own ``IndexedDatasetBuilder`` into a private
directory next to the output and renamed into place only when every dataset is complete, so a
failed run leaves no ``.bin``/``.idx`` behind (and leaves any previous output untouched).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np

from mindspeed_llm.data.templates import IGNORE_INDEX


def import_indexed_dataset():
    """``megatron.core.datasets.indexed_dataset``, imported without its start-up noise.

    Importing megatron-core warns about missing Transformer Engine / Apex and deprecated torch
    APIs, and torch logs a missing CUDA runtime; none of it matters for writing token files,
    and a user running ``preprocess-data`` on a laptop should not have to read it.
    """
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    finally:
        quiet.setLevel(level)
    return indexed_dataset


def dataset_prefix(output_prefix: str | Path, suffix: str, key: str) -> str:
    """MindSpeed-LLM's name of one output: ``{prefix}{suffix}_{key}_document``."""
    return f"{output_prefix}{suffix}_{key}_document"


class IndexedOutputs:
    """One ``IndexedDatasetBuilder`` per key, committed together.

    Args:
        prefixes: key -> final path prefix (``.bin``/``.idx`` are appended).
        dtype: the token dtype of every dataset.
    """

    def __init__(self, prefixes: dict[str, str], dtype: type[np.number]) -> None:
        IndexedDatasetBuilder = import_indexed_dataset().IndexedDatasetBuilder  # noqa: N806

        self.prefixes = dict(prefixes)
        first = Path(next(iter(self.prefixes.values())))
        self.created_dir = None if first.parent.exists() else first.parent
        first.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = first.parent / f".{first.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp_dir.mkdir()
        self.builders = {key: IndexedDatasetBuilder(str(self._tmp(key, ".bin")), dtype=dtype) for key in self.prefixes}
        self.documents = 0

    def _tmp(self, key: str, ext: str) -> Path:
        return self.tmp_dir / (Path(self.prefixes[key]).name + ext)

    def add_document(self, sequences: dict[str, np.ndarray]) -> None:
        """Append one document (one sequence per key) to every dataset."""
        for key, builder in self.builders.items():
            builder.add_document(sequences[key], [len(sequences[key])])
        self.documents += 1

    def add_to(self, key: str, sequence: np.ndarray) -> None:
        """Append one single-sequence document to the dataset ``key`` only."""
        self.builders[key].add_document(sequence, [len(sequence)])

    def commit(self) -> list[str]:
        """Write the indexes and move every file into place; returns the final prefixes."""
        for key, builder in self.builders.items():
            builder.finalize(str(self._tmp(key, ".idx")))
        for key, final in self.prefixes.items():
            for ext in (".bin", ".idx"):
                os.replace(self._tmp(key, ext), final + ext)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return list(self.prefixes.values())

    def abort(self) -> None:
        """Drop everything written so far."""
        for builder in self.builders.values():
            builder.data_file.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        if self.created_dir is not None:
            with contextlib.suppress(OSError):  # only if still empty: someone may have written there meanwhile
                self.created_dir.rmdir()


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group sample indices into packs of total length <= ``capacity`` (best fit decreasing).

    Deterministic: longer samples are placed first (ties by index), each into the fullest
    pack it still fits; indices within a pack are in input order.

    Args:
        lengths: length of each sample (each at most ``capacity``).
        capacity: the pack size (``--seq-length``).

    Returns:
        The packs, as lists of sample indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    # (room left, pack number), sorted: the first entry with room >= n is the best fit.
    rooms: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than the pack size {capacity}")
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, p = rooms.pop(at)
        else:
            room, p = capacity, len(packs)
            packs.append([])
        packs[p].append(i)
        if room - n > 0:
            bisect.insort(rooms, (room - n, p))
    return [sorted(pack) for pack in packs]


def build_pack(samples: list[dict[str, np.ndarray]], seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Concatenate instruction samples into one ``seq_length`` row, keeping their boundaries.

    ``attention_mask`` holds the 1-based number of the sample each token belongs to (0 on
    padding), so a trainer can rebuild per-sample attention and position ids; labels are
    -100 on padding and input ids are ``pad_id`` there.
    """
    input_ids = np.full(seq_length, pad_id, dtype=np.int32)
    labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int32)
    segments = np.zeros(seq_length, dtype=np.int32)
    at = 0
    for number, sample in enumerate(samples, start=1):
        n = len(sample["input_ids"])
        input_ids[at : at + n] = sample["input_ids"]
        labels[at : at + n] = sample["labels"]
        segments[at : at + n] = number
        at += n
    return {"input_ids": input_ids, "attention_mask": segments, "labels": labels}
