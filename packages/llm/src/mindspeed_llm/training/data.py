"""Training and validation data: megatron-core's GPT datasets over indexed datasets, and batches.

The datasets are megatron-core's own: ``BlendedMegatronDatasetBuilder`` builds ``GPTDataset``
splits (``data.split``) of every prefix and blends them by ``data.weights``. Batches follow
megatron's pretraining sampler: step ``k`` reads the global samples
``[consumed, consumed + global_batch)``, microbatch ``m`` of data-parallel rank ``r`` the
``micro_batch_size`` samples at ``consumed + (m * dp + r) * micro_batch_size``. The position
in the data is therefore one number, the consumed samples, which checkpoints store.
Every rank reads its own samples from the memory-mapped files (tensor- and pipeline-parallel
ranks read the same ones), so no broadcast is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.config import ConfigError
from mindspeed.log import get_logger
from mindspeed_llm.tokenizer import tokenizer_sizes
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.data_check import check_indexed_dataset
from mindspeed_llm.training.model import padded_vocab_size

logger = get_logger(__name__)

#: Fields of a batch the forward step uses.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class TokenIds:
    """What megatron's GPT datasets ask of a tokenizer: the vocabulary size and the end-of-document id.

    Megatron reads ``pad`` in a ``try`` and falls back to an id that never occurs (-1): these
    datasets hold no padding, so there is no ``pad`` attribute.
    """

    vocab_size: int
    eod: int

    @property
    def eos(self) -> int:
        """The end-of-sequence id (the end-of-document id)."""
        return self.eod

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """What megatron hashes into the names of its cached sample indices."""
        return {"class": "TokenIds", "vocab_size": self.vocab_size, "eod": self.eod}


def read_tokenizer(config: PretrainConfig) -> TokenIds:
    """Vocabulary size and end-of-document id from the recipe, else from ``data.tokenizer``.

    ``data.tokenizer`` is a local Hugging Face tokenizer directory or ``demo`` (the demo BPE,
    see :mod:`mindspeed_llm.tokenizer`).

    Raises:
        ConfigError: when the tokenizer cannot be opened.
    """
    vocab, eod = config.model.vocab_size, config.data.eod_token_id
    if config.data.tokenizer and (vocab is None or eod is None):
        try:
            size, eos = tokenizer_sizes(config.data.tokenizer)
        except ValueError as err:
            raise ConfigError(f"data.tokenizer: {err}") from err
        vocab = vocab if vocab is not None else size
        if eod is None:
            eod = eos
    if vocab is None:
        raise ConfigError("model.vocab_size is unset; set it or give data.tokenizer")
    return TokenIds(vocab_size=vocab, eod=eod if eod is not None else 0)


def build_datasets(config: PretrainConfig, world_size: int, ids: TokenIds) -> tuple[Any, Any]:
    """The train and validation datasets (validation ``None`` when no evaluation is asked for).

    Collective: every rank must call it (megatron builds on rank 0 first, then the others read
    its cached indices).

    Raises:
        ConfigError: a split without documents, or too little data for the run.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    d = config.data
    gbs = config.global_batch_size(world_size)
    evaluates = config.eval.interval is not None or config.eval.at_end
    sizes = [max(config.train.steps, 1) * gbs, config.eval.iters * gbs if evaluates else 0, 0]
    blend = None if d.mock else (list(d.prefixes), list(d.weights) if d.weights is not None else None)
    dataset_config = GPTDatasetConfig(
        random_seed=config.train.seed,
        sequence_length=d.seq_length,
        blend=blend,
        split=d.split,
        path_to_cache=_cache_dir(config),
        tokenizer=ids,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    # Megatron loops forever on a split without documents (it counts epochs until their tokens
    # cover the request); unused splits are dropped from the matrix, which leaves the bookends of
    # the others, and so the documents each split gets, unchanged.
    matrix = dataset_config.split_matrix
    counts = (
        {} if d.mock else {prefix: check_indexed_dataset(prefix, token_limit(config, ids)) for prefix in d.prefixes}
    )
    for index, needed in enumerate((True, evaluates, False)):
        if not needed:
            matrix[index] = None
        elif not d.mock:
            _check_split_documents(counts, matrix[index], ("train", "validation")[index])
    cls = MockGPTDataset if d.mock else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, dataset_config).build()
    if train is None or len(train) < sizes[0]:
        raise ConfigError(
            f"the train split has {0 if train is None else len(train)} samples, fewer than the "
            f"{sizes[0]} the run needs; check data.split and data.prefixes"
        )
    if evaluates and (valid is None or len(valid) < sizes[1]):
        raise ConfigError(
            f"evaluation needs {sizes[1]} validation samples (eval.iters x global batch) but the "
            f"validation split has {0 if valid is None else len(valid)}; give data.split a larger "
            "valid part, lower eval.iters, or add data"
        )
    logger.info(
        "data: %d train samples%s of %d tokens",
        len(train),
        f", {len(valid)} validation samples" if valid is not None and evaluates else "",
        d.seq_length,
    )
    return train, (valid if evaluates else None)


def _cache_dir(config: PretrainConfig) -> str | None:
    # Megatron caches the sample indices of each dataset next to it by default, but those of a
    # blend nowhere; one directory for both lets every rank after rank 0 read rather than rebuild.
    if config.data.cache_dir:
        return config.data.cache_dir
    if config.data.mock or not config.data.prefixes:
        return None
    return str(Path(config.data.prefixes[0]).parent / "cache")


def token_limit(config: PretrainConfig, ids: TokenIds) -> int:
    """Token ids of the data must be below this: the embedding's rows (the padded vocabulary)."""
    return padded_vocab_size(ids.vocab_size, config.model.make_vocab_size_divisible_by, config.parallel.tp)


def _check_split_documents(counts: dict[str, int], bookends: tuple[float, float] | None, name: str) -> None:
    for prefix, count in counts.items():
        begin, end = (0, 0) if bookends is None else (round(bookends[0] * count), round(bookends[1] * count))
        if end <= begin:
            raise ConfigError(
                f"data.split={','.join(map(str, bookends or ()))!s}: the {name} split of {prefix} gets none "
                f"of its {count} documents; give that split a larger share or add documents"
            )


class MicrobatchReader:
    """This data-parallel rank's microbatches of a dataset, by consumed-sample position.

    Args:
        dataset: a megatron GPT dataset (indexable, dict samples).
        micro_batch_size: sequences per microbatch.
        dp_rank: this rank's data-parallel index.
        dp_size: the data-parallel size.
        device: where the batches go.
    """

    def __init__(self, dataset: Any, micro_batch_size: int, dp_rank: int, dp_size: int, device: torch.device) -> None:
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size, self.device = micro_batch_size, dp_rank, dp_size, device

    def microbatch(self, consumed: int, index: int) -> dict[str, torch.Tensor]:
        """Microbatch ``index`` of the step that starts at global sample ``consumed``."""
        start = consumed + (index * self.dp_size + self.dp_rank) * self.micro_batch_size
        samples = [self.dataset[i] for i in range(start, start + self.micro_batch_size)]
        return {key: torch.stack([s[key] for s in samples]).to(self.device) for key in BATCH_KEYS}

    def step(self, consumed: int, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
        """All microbatches of the step that starts at global sample ``consumed``."""
        return [self.microbatch(consumed, m) for m in range(num_microbatches)]


def pack_documents(batch: dict[str, torch.Tensor], eod: int, segment_multiple: int = 1) -> dict[str, Any]:
    """A ``[b, s]`` pretraining microbatch as one packed (THD) row whose sequences are its documents.

    Megatron's ``reset_attention_mask`` / ``reset_position_ids``: a document ends after each
    end-of-document token (the token stays with the document before it, and still predicts the
    next document's first token unless ``eod_mask_loss`` masks it); every sample starts a new
    sequence. Attention stays inside each ``cu_seqlens`` segment and positions restart at 0 in
    each (megatron's rope does so for THD rows).

    Args:
        batch: ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` of ``[b, s]``.
        eod: the end-of-document token.
        segment_multiple: pad each document (inside its segment, never trained) to a multiple of
            this (``2 x cp`` under context parallelism).

    Returns:
        ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of ``[1, T]``, ``cu_seqlens``
        (int32) and ``max_seqlen``.
    """
    tokens = batch["tokens"]
    device = tokens.device
    lengths: list[int] = []
    for row in tokens.cpu():
        ends = (row == eod).nonzero().flatten().add(1).tolist()
        cuts = [0, *[e for e in ends if e < len(row)], len(row)]
        lengths += [b - a for a, b in zip(cuts, cuts[1:])]
    flat = {key: batch[key].reshape(-1) for key in ("tokens", "labels", "loss_mask")}
    pieces: dict[str, list[torch.Tensor]] = {key: [] for key in (*flat, "position_ids")}
    bounds, start = [0], 0
    for length in lengths:
        pad = -length % segment_multiple
        for key, value in flat.items():
            piece = value[start : start + length]
            filler = torch.zeros(pad, dtype=value.dtype, device=device)
            pieces[key].append(torch.cat([piece, filler]) if pad else piece)
        pieces["position_ids"].append(torch.arange(length + pad, device=device))
        bounds.append(bounds[-1] + length + pad)
        start += length
    out: dict[str, Any] = {key: torch.cat(value).unsqueeze(0) for key, value in pieces.items()}
    out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
    out["max_seqlen"] = max(b - a for a, b in zip(bounds, bounds[1:]))
    return out


class DocumentResetReader:
    """A pretraining reader whose microbatches are packed documents (:func:`pack_documents`).

    Args:
        reader: the :class:`MicrobatchReader`.
        eod: the end-of-document token.
        segment_multiple: see :func:`pack_documents`.
    """

    def __init__(self, reader: MicrobatchReader, eod: int, segment_multiple: int = 1) -> None:
        self.reader, self.eod, self.segment_multiple = reader, eod, segment_multiple

    def step(self, consumed: int, num_microbatches: int) -> list[dict[str, Any]]:
        """The step's microbatches, each one packed row."""
        return [
            pack_documents(b, self.eod, self.segment_multiple) for b in self.reader.step(consumed, num_microbatches)
        ]
