"""Indexed datasets are checked when opened: damaged headers, indices, truncated .bin files and out-of-vocabulary ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from mindspeed.config import ConfigError
from mindspeed_llm.training.data_check import HEADER_BYTES, check_indexed_dataset
from mindspeed_llm.training.finetune_data import check_finetune_data
from tests.llm.training.datasets import write_indexed_dataset
from tests.llm.training.finetune_data import make_samples, write_instruction, write_pairwise

DOCS = 30


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_indexed_dataset(tmp_path_factory.mktemp("check") / "d", DOCS, seed=1, vocab=128)


def _copy(good: str, tmp_path: Path) -> str:
    for ext in (".bin", ".idx"):
        shutil.copy(good + ext, tmp_path / f"d{ext}")
    return str(tmp_path / "d")


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _error(prefix: str, vocab: int | None = 128, ignore: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        check_indexed_dataset(prefix, vocab, ignore)
    message = str(info.value)
    assert "\n" not in message and "preprocess-data" in message, message
    return message


def test_a_good_dataset_passes_and_is_counted(good: str) -> None:
    assert check_indexed_dataset(good, 128) == DOCS
    # The dataset megatron reads is the same one.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert len(IndexedDataset(good)) == DOCS


def test_damaged_index_and_data_are_one_line_naming_file_and_sequence(good: str, tmp_path: Path) -> None:
    prefix = _copy(good, tmp_path)
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    pristine = {ext: Path(prefix + ext).read_bytes() for ext in (".bin", ".idx")}

    def restore() -> None:
        for ext, data in pristine.items():
            Path(prefix + ext).write_bytes(data)

    # 64 bytes overwritten inside the sequence pointers (the damage): sequence 1 is the first that moves.
    pointers = HEADER_BYTES + 4 * DOCS
    _patch(idx, pointers + 8, bytes(range(7, 71)))
    message = _error(prefix)
    assert idx in message and "sequence 1 " in message, message
    restore()
    # 64 bytes overwritten inside the lengths: the sequence after the first changed length is named.
    _patch(idx, HEADER_BYTES + 8, b"\x01" * 64)
    message = _error(prefix)
    assert idx in message and "sequence 3 starts" in message, message
    restore()
    # Header: magic, version, dtype code, a count that does not fit the file.
    for offset, data, words in (
        (0, b"XXIDIDX", "header is damaged"),
        (9, b"\x02", "version 2"),
        (17, b"\x09", "dtype code 9"),
        (18, b"\xff", "announces"),
    ):
        _patch(idx, offset, data)
        assert words in _error(prefix), words
        restore()
    # Document boundaries that do not end at the sequence count.
    _patch(idx, len(pristine[".idx"]) - 8, np.int64(DOCS + 5).tobytes())
    assert "document boundaries" in _error(prefix)
    restore()
    # A truncated .bin names the .bin and the first sequence it cuts.
    ends = np.cumsum(np.frombuffer(pristine[".idx"], np.int32, DOCS, HEADER_BYTES)) * 4
    Path(bin_).write_bytes(pristine[".bin"][: int(ends[-3]) + 4])
    message = _error(prefix)
    assert bin_ in message and "truncated" in message and f"sequence {DOCS - 2} " in message, message
    # A .bin longer than the index: another dataset's .idx.
    Path(bin_).write_bytes(pristine[".bin"] + b"\0" * 8)
    assert "not one dataset" in _error(prefix)
    restore()
    # An id outside the vocabulary: the sequence and the position inside it.
    _patch(bin_, int(ends[4]) + 3 * 4, np.int32(70000).tobytes())
    message = _error(prefix)
    assert bin_ in message and "sequence 5 holds token id 70000 at position 3" in message, message
    _patch(bin_, int(ends[4]) + 3 * 4, np.int32(-5).tobytes())
    assert "token id -5" in _error(prefix)
    restore()
    # A model with a smaller vocabulary than the tokenizer the data was written with.
    assert "vocabulary of 64" in _error(prefix, vocab=64)
    with pytest.raises(ConfigError, match="not found"):
        check_indexed_dataset(str(tmp_path / "missing"), 128)


def test_instruction_labels_may_be_ignored_but_not_out_of_range(tmp_path: Path) -> None:
    prefix = write_instruction(str(tmp_path / "sft"), make_samples(12, seed=0, vocab=128))
    keys = ("input_ids", "attention_mask", "labels")
    check_finetune_data([prefix], keys, 128)  # labels hold -100; attention masks are not token ids
    labels = f"{prefix}_packed_labels_document.bin"
    data = np.fromfile(labels, np.int32)
    data[7] = -99
    data.tofile(labels)
    with pytest.raises(ConfigError, match="labels_document.bin: sequence 0 holds token id -99"):
        check_finetune_data([prefix], keys, 128)
    with pytest.raises(ConfigError, match="input_ids_document.bin: .*vocabulary of 16"):
        check_finetune_data([prefix], keys, 16)


def test_every_stage_checks_its_data_when_it_opens_it(good: str, tmp_path: Path) -> None:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.data import TokenIds
    from mindspeed_llm.training.stages import get_stage

    # Written with a 256-token vocabulary, read by a model of 128 (padded to 128: divisible by 64).
    pairs = write_pairwise(str(tmp_path / "pairs"), 20, seed=0, vocab=256)
    sft = write_instruction(str(tmp_path / "sft"), make_samples(20, seed=0, vocab=256))
    ids = TokenIds(vocab_size=128, eod=0)
    for stage, prefix, damaged in (
        ("dpo", pairs, "chosen_input_ids_document.bin"),
        ("sft", sft, "input_ids_document.bin"),
        ("pretrain", _copy(good, tmp_path), "d.idx"),
    ):
        if stage == "pretrain":
            _patch(prefix + ".idx", HEADER_BYTES + 4 * DOCS + 8, bytes(64))
        config = load_pretrain_config(
            None, [f"stage={stage}", f"data.prefixes=[{prefix}]", "model.vocab_size=128", "data.split=100,0,0"]
        )
        with pytest.raises(ConfigError, match=f"{damaged}: sequence"):
            get_stage(stage).datasets(config, 1, ids)
