"""Instruction and preference data for ``sft`` and ``dpo``, batched as packed (THD) sequences.

The datasets are what ``preprocess-data`` writes (MindSpeed-LLM's names):

- instruction data ``{prefix}_packed_{input_ids,attention_mask,labels}_document``: one sample
  (or, with ``--pack``, one row of several samples) per document; labels are -100 on prompt
  tokens; in a packed row ``attention_mask`` numbers the samples 1, 2, ... (0 on padding).
- pairwise data ``{prefix}_packed_{chosen,rejected}_{input_ids,labels}_document``.

A microbatch is one packed sequence ``[1, T]``: its samples one after another, each its own
``cu_seqlens`` segment, so attention never crosses a sample boundary and rope positions restart
(megatron's THD format, see ``RegistryAttention``). Samples keep their own lengths (nothing is
padded per sample); the microbatch is padded at the end to ``micro_batch_size x seq_length``
tokens (the same shape for every microbatch, as pipeline parallelism needs), or with
``data.variable_seq_lengths`` to a multiple of ``data.pad_to_multiple_of`` only. Targets are
shifted inside each sample: token ``t`` is trained to predict token ``t + 1`` of the same
sample where that token's label is not -100, so nothing is learnt across a boundary or on a prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mindspeed.config import ConfigError
from mindspeed.log import get_logger
from mindspeed_llm.training.data_check import check_indexed_dataset

logger = get_logger(__name__)

IGNORE_INDEX = -100
INSTRUCTION_KEYS = ("input_ids", "attention_mask", "labels")
PAIRWISE_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def _existing(prefix: str, key: str) -> str:
    path = f"{prefix}_packed_{key}_document"
    if not (Path(path + ".bin").is_file() and Path(path + ".idx").is_file()):
        raise ConfigError(
            f"data.prefixes: {path}.bin/.idx not found; give the --output-prefix that "
            "preprocess-data was run with (instruction or pairwise handler)"
        )
    return path


def _open(prefix: str, key: str) -> Any:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(_existing(prefix, key))


def check_finetune_data(prefixes: list[str], keys: tuple[str, ...], vocab_size: int) -> None:
    """Check every dataset of ``prefixes`` before training (:func:`check_indexed_dataset`).

    Token ids must be below ``vocab_size``; labels may also be -100 (prompt tokens); the
    attention-mask datasets number samples, not tokens, and get the structural checks only.
    """
    for prefix in prefixes:
        for key in keys:
            path = _existing(prefix, key)  # a missing file is named with the preprocess-data hint
            limit = None if key.endswith("attention_mask") else vocab_size
            check_indexed_dataset(path, limit, IGNORE_INDEX if key.endswith("labels") else None)


def _split_bounds(split: str, count: int) -> list[tuple[int, int]]:
    weights = [float(x) for x in split.replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    edges = [0]
    for w in weights:
        edges.append(edges[-1] + w / total)
    cuts = [round(e * count) for e in edges]
    return [(cuts[i], cuts[i + 1]) for i in range(3)]


class DocumentDataset:
    """The documents of one split of several indexed datasets, shuffled per epoch, endless.

    Sample ``i`` is document ``perm_e[i mod n]`` of epoch ``e = i // n``: the order is fixed by
    the seed, so the data position is one number (the consumed samples) as in pretraining.

    Args:
        prefixes: dataset prefixes (``preprocess-data``'s ``--output-prefix``).
        keys: the datasets of each prefix (``INSTRUCTION_KEYS`` or ``PAIRWISE_KEYS``).
        split: ``data.split``.
        index: 0 train, 1 validation.
        seed: shuffling seed.
        shuffle: shuffle (train) or keep the file order (validation).
    """

    def __init__(
        self, prefixes: list[str], keys: tuple[str, ...], split: str, index: int, seed: int, shuffle: bool
    ) -> None:
        self.parts: list[tuple[dict[str, Any], int]] = []  # (datasets of a prefix, document)
        for prefix in prefixes:
            sets = {key: _open(prefix, key) for key in keys}
            counts = {len(ds) for ds in sets.values()}
            if len(counts) != 1:
                raise ConfigError(
                    f"data.prefixes: the datasets of {prefix} have different document counts {counts}; "
                    "run preprocess-data again"
                )
            begin, end = _split_bounds(split, counts.pop())[index]
            self.parts.extend((sets, doc) for doc in range(begin, end))
        self.keys, self.seed, self.shuffle = keys, seed, shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.parts)

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            order = np.arange(len(self.parts))
            if self.shuffle:
                np.random.RandomState(self.seed + epoch).shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = len(self.parts)
        sets, doc = self.parts[int(self._order(i // n)[i % n])]
        return {key: np.asarray(sets[key][doc], dtype=np.int64) for key in self.keys}


@dataclass(frozen=True)
class PackSettings:
    """How microbatches are packed.

    Attributes:
        seq_length: the longest sample (longer ones are cut) and the row length of packed data.
        micro_batch_size: samples (or pairs) per microbatch.
        variable: pad each microbatch only to a multiple of ``pad_to_multiple_of``.
        pad_to_multiple_of: the multiple (tensor parallelism with sequence parallelism needs tp).
        pad_id: the token padding is filled with.
        segment_multiple: pad every sample to a multiple of this inside its own segment (context
            parallelism splits each packed sequence into ``2 x cp`` equal chunks); the padding
            is never trained and, at the end of its sample, changes nothing the sample's tokens see.
    """

    seq_length: int
    micro_batch_size: int
    variable: bool = False
    pad_to_multiple_of: int = 8
    pad_id: int = 0
    segment_multiple: int = 1


def _segments(sample: dict[str, np.ndarray], prefix: str = "") -> list[tuple[np.ndarray, np.ndarray]]:
    # A packed row holds several samples numbered by its attention mask; other data one each.
    ids, labels = sample[f"{prefix}input_ids"], sample[f"{prefix}labels"]
    mask = sample.get(f"{prefix}attention_mask")
    if mask is None or mask.max(initial=0) <= 1:
        keep = len(ids) if mask is None or mask.min(initial=1) > 0 else int((mask > 0).sum())
        return [(ids[:keep], labels[:keep])]
    return [
        (ids[mask == number], labels[mask == number])
        for number in range(1, int(mask.max()) + 1)
        if (mask == number).any()
    ]


def pack_microbatch(
    sequences: list[tuple[np.ndarray, np.ndarray]], settings: PackSettings, sequence_ids: list[int] | None = None
) -> dict[str, Any]:
    """One THD microbatch of ``sequences`` (``(input_ids, labels)`` pairs, labels aligned with ids).

    Args:
        sequences: the samples, in order.
        settings: lengths and padding.
        sequence_ids: per sample, the number its tokens carry in ``sequence_index`` (default
            0, 1, ...; DPO numbers chosen and rejected answers of pair ``k`` as ``2k``, ``2k + 1``).

    Returns:
        ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (``[1, T]``), ``sequence_index``
        (``[T]``, -1 on padding), ``cu_seqlens`` (int32) and ``max_seqlen``.
    """
    total = settings.micro_batch_size * settings.seq_length
    tokens, targets, positions, index, bounds = [], [], [], [], [0]
    for number, (ids, labels) in enumerate(sequences):
        ids, labels = ids[: settings.seq_length], labels[: settings.seq_length]
        shifted = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        shifted[:-1] = labels[1:]
        extra = -len(ids) % settings.segment_multiple
        tokens.append(np.concatenate([ids, np.full(extra, settings.pad_id, dtype=ids.dtype)]))
        targets.append(np.concatenate([shifted, np.full(extra, IGNORE_INDEX, dtype=np.int64)]))
        positions.append(np.arange(len(ids) + extra))
        index.append(
            np.concatenate(
                [np.full(len(ids), number if sequence_ids is None else sequence_ids[number]), np.full(extra, -1)]
            )
        )
        bounds.append(bounds[-1] + len(ids) + extra)
    used = bounds[-1]
    if settings.variable:
        multiple = math.lcm(settings.pad_to_multiple_of, settings.segment_multiple)
        total = max(-(-used // multiple) * multiple, multiple)
    if used > total and settings.segment_multiple > 1:
        total = used  # samples padded for context parallelism overflow the row: this microbatch is longer
    if used > total:  # cannot happen with samples cut to seq_length; a guard for callers
        raise ValueError(f"{used} tokens do not fit a microbatch of {total}")
    if used < total:  # the padding is one more segment, attended only by itself, never trained
        pad = total - used
        tokens.append(np.full(pad, settings.pad_id))
        targets.append(np.full(pad, IGNORE_INDEX))
        positions.append(np.arange(pad))
        index.append(np.full(pad, -1))
        bounds.append(total)
    labels = torch.from_numpy(np.concatenate(targets)).unsqueeze(0)
    loss_mask = (labels != IGNORE_INDEX).float()
    lengths = np.diff(bounds)
    return {
        "tokens": torch.from_numpy(np.concatenate(tokens)).long().unsqueeze(0),
        "labels": labels.clamp_min(0),
        "loss_mask": loss_mask,
        "position_ids": torch.from_numpy(np.concatenate(positions)).long().unsqueeze(0),
        "sequence_index": torch.from_numpy(np.concatenate(index)).long(),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_seqlen": int(lengths.max()),
    }


def instruction_microbatch(samples: list[dict[str, np.ndarray]], settings: PackSettings) -> dict[str, Any]:
    """The THD microbatch of instruction samples (packed rows are split back into their samples)."""
    return pack_microbatch([seg for s in samples for seg in _segments(s)], settings)


def pairwise_microbatch(samples: list[dict[str, np.ndarray]], settings: PackSettings) -> dict[str, Any]:
    """The THD microbatch of preference pairs: chosen then rejected answer of each pair.

    ``sequence_index`` is ``2k`` on the chosen and ``2k + 1`` on the rejected answer of pair
    ``k``; the microbatch holds ``2 x micro_batch_size x seq_length`` tokens.
    """
    sequences, ids = [], []
    for k, sample in enumerate(samples):
        sequences += [
            (sample["chosen_input_ids"], sample["chosen_labels"]),
            (sample["rejected_input_ids"], sample["rejected_labels"]),
        ]
        ids += [2 * k, 2 * k + 1]
    doubled = PackSettings(
        settings.seq_length,
        2 * settings.micro_batch_size,
        settings.variable,
        settings.pad_to_multiple_of,
        settings.pad_id,
    )
    return pack_microbatch(sequences, doubled, ids)


class PackedMicrobatchReader:
    """This data-parallel rank's THD microbatches of a :class:`DocumentDataset`, by consumed samples.

    The same sampler as :class:`~mindspeed_llm.training.data.MicrobatchReader`: microbatch ``m``
    of data-parallel rank ``r`` reads the samples at ``consumed + (m * dp + r) * micro_batch_size``.
    """

    def __init__(
        self,
        dataset: DocumentDataset,
        settings: PackSettings,
        pairwise: bool,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
    ) -> None:
        self.dataset, self.settings, self.pairwise = dataset, settings, pairwise
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device

    def microbatch(self, consumed: int, index: int) -> dict[str, Any]:
        """Microbatch ``index`` of the step that starts at global sample ``consumed``."""
        mbs = self.settings.micro_batch_size
        start = consumed + (index * self.dp_size + self.dp_rank) * mbs
        samples = [self.dataset[i] for i in range(start, start + mbs)]
        build = pairwise_microbatch if self.pairwise else instruction_microbatch
        batch = build(samples, self.settings)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def step(self, consumed: int, num_microbatches: int) -> list[dict[str, Any]]:
        """All microbatches of the step that starts at global sample ``consumed``."""
        return [self.microbatch(consumed, m) for m in range(num_microbatches)]
