"""Indexed datasets checked when they are opened, not when a damaged sample is read hours later.

A Megatron indexed dataset is ``PREFIX.idx`` (a header, then the length of every sequence, its
byte offset in ``PREFIX.bin`` and the document boundaries) and ``PREFIX.bin`` (the tokens).
:func:`check_indexed_dataset` reads both without megatron and checks what megatron's reader
trusts: the header (magic, version, dtype code), that the ``.idx`` holds exactly the arrays
its counts announce, that every sequence starts where the one before it ends (the builder
writes them back to back) and ends inside the ``.bin``, that the document boundaries rise
from 0 to the sequence count, and that every token id is below the model's (padded)
vocabulary: a vectorised scan of the memory-mapped ``.bin``, in chunks (about 0.05 s per
100 MB, see ``docs/reliability.md``). A problem is a :class:`~mindspeed.config.ConfigError`
of one line naming the file, the sequence and the fix.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from mindspeed.config import ConfigError

#: The first bytes of every ``.idx`` file megatron-core writes.
MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
#: megatron-core's ``DType`` codes.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
#: Tokens read per chunk of the vocabulary scan (bounded memory on any file size).
CHUNK_TOKENS = 1 << 24
FIX = "run preprocess-data again to rewrite it"


def check_indexed_dataset(prefix: str | Path, vocab_size: int | None = None, ignore_index: int | None = None) -> int:
    """Check ``prefix.idx`` / ``prefix.bin``; returns the number of sequences.

    Args:
        prefix: the dataset prefix (``PREFIX`` of ``PREFIX.bin`` / ``PREFIX.idx``).
        vocab_size: every token id must be in ``[0, vocab_size)`` (``None``: no token check,
            e.g. the attention-mask datasets of instruction data).
        ignore_index: a value allowed besides (labels hold -100 on prompt tokens).

    Raises:
        ConfigError: a missing file, a damaged header or index, a ``.bin`` shorter than the
            index says, or a token id outside the vocabulary.
    """
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise ConfigError(f"data.prefixes: {path} not found; give the --output-prefix that preprocess-data wrote")
    dtype, lengths, pointers, documents = _read_index(idx)
    itemsize = np.dtype(dtype).itemsize
    _check_pointers(idx, lengths, pointers, itemsize)
    _check_documents(idx, documents, len(lengths))
    size = bin_.stat().st_size
    ends = pointers + lengths.astype(np.int64) * itemsize
    if len(ends) and int(ends[-1]) != size:
        if int(ends[-1]) > size:
            seq = int(np.argmax(ends > size))
            raise ConfigError(
                f"data.prefixes: {bin_} is truncated: it holds {size} bytes but sequence {seq} of {idx.name} ends at "
                f"byte {int(ends[seq])}; {FIX}"
            )
        raise ConfigError(
            f"data.prefixes: {bin_} holds {size} bytes but {idx.name} describes {int(ends[-1])}: the two files are not "
            f"one dataset; {FIX}"
        )
    if vocab_size is not None and np.issubdtype(dtype, np.integer) and size:
        _scan_tokens(bin_, dtype, pointers, itemsize, vocab_size, ignore_index)
    return len(lengths)


def _read_index(idx: Path) -> tuple[type, np.ndarray, np.ndarray, np.ndarray]:
    data = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else np.zeros(0, np.uint8)
    head = bytes(data[:HEADER_BYTES])
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise ConfigError(f"data.prefixes: {idx} is not a Megatron index (its header is damaged); {FIX}")
    version, code, count, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise ConfigError(f"data.prefixes: {idx} has index version {version}, not 1 (damaged header); {FIX}")
    if code not in DTYPES:
        raise ConfigError(f"data.prefixes: {idx} has token dtype code {code}, not one of 1-8 (damaged header); {FIX}")
    expected = HEADER_BYTES + 12 * count + 8 * docs
    if len(data) not in (expected, expected + count):  # + count: megatron's multimodal sequence modes
        raise ConfigError(
            f"data.prefixes: {idx} holds {len(data)} bytes but its header announces {count} sequences and {docs} "
            f"document boundaries ({expected} bytes): damaged or truncated; {FIX}"
        )
    offset = HEADER_BYTES
    lengths = np.frombuffer(data, np.int32, count, offset)
    pointers = np.frombuffer(data, np.int64, count, offset + 4 * count)
    documents = np.frombuffer(data, np.int64, docs, offset + 12 * count)
    return DTYPES[code], lengths, pointers, documents


def _check_pointers(idx: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> None:
    if not len(lengths):
        return
    negative = np.flatnonzero(lengths < 0)
    if len(negative):
        seq = int(negative[0])
        raise ConfigError(f"data.prefixes: {idx}: sequence {seq} has length {int(lengths[seq])}; {FIX}")
    # The builder writes the sequences back to back: each starts where the one before it ends.
    expected = np.zeros_like(pointers)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected[1:])
    wrong = np.flatnonzero(pointers != expected)
    if len(wrong):
        seq = int(wrong[0])
        raise ConfigError(
            f"data.prefixes: {idx}: sequence {seq} starts at byte {int(pointers[seq])}, not where the sequences "
            f"before it end ({int(expected[seq])}): the index is damaged; {FIX}"
        )


def _check_documents(idx: Path, documents: np.ndarray, count: int) -> None:
    if not len(documents) or documents[0] != 0 or documents[-1] != count or np.any(np.diff(documents) < 0):
        bad = np.flatnonzero(np.diff(documents) < 0) if len(documents) else []
        where = f" at document {int(bad[0]) + 1}" if len(bad) else ""
        raise ConfigError(
            f"data.prefixes: {idx}: the document boundaries do not rise from 0 to the {count} sequences{where}: "
            f"the index is damaged; {FIX}"
        )


def _scan_tokens(
    bin_: Path, dtype: type, pointers: np.ndarray, itemsize: int, vocab_size: int, ignore_index: int | None
) -> None:
    tokens = np.memmap(bin_, dtype=dtype, mode="r")
    for start in range(0, len(tokens), CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        low, high = chunk.min(), chunk.max()
        if high < vocab_size and (
            low >= 0 or (ignore_index is not None and _only_ignored_negatives(chunk, ignore_index))
        ):
            continue
        bad = (chunk >= vocab_size) | (chunk < 0)
        if ignore_index is not None:
            bad &= chunk != ignore_index
        position = start + int(np.argmax(bad))
        seq = int(np.searchsorted(pointers, position * itemsize, side="right")) - 1
        offset = position - int(pointers[seq]) // itemsize
        raise ConfigError(
            f"data.prefixes: {bin_}: sequence {seq} holds token id {int(tokens[position])} at position {offset}, outside "
            f"the model's vocabulary of {vocab_size} (padded): the data is damaged or was tokenized with another "
            f"tokenizer; {FIX} with the model's tokenizer"
        )


def _only_ignored_negatives(chunk: np.ndarray, ignore_index: int) -> bool:
    return not np.any((chunk < 0) & (chunk != ignore_index))
