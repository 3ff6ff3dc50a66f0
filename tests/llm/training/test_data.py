"""Data: blending follows the weights, splits are disjoint, readers follow megatron's sampler order."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from mindspeed.config import ConfigError
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_llm.training.data import MicrobatchReader, TokenIds, build_datasets
from tests.llm.training.datasets import write_indexed_dataset


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    # Megatron's blended datasets ask torch.distributed for the rank when they cache indices.
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("blend")
    return [write_indexed_dataset(root / "a", 120, seed=5), write_indexed_dataset(root / "b", 120, seed=6)]


def test_blend_weights_and_split(prefixes: list[str]) -> None:
    config = load_pretrain_config(
        None,
        [
            f"data.prefixes=[{prefixes[0]},{prefixes[1]}]",
            "data.weights=[0.8,0.2]",
            "data.seq_length=16",
            "data.split=80,20,0",
            "model.vocab_size=128",
            "train.steps=50",
            "train.micro_batch_size=4",
            "eval.at_end=true",
            "eval.iters=3",
        ],
    )
    train, valid = build_datasets(config, 1, TokenIds(vocab_size=128, eod=0))
    assert len(train) >= 200 and len(valid) >= 12
    share = Counter(int(train[i]["dataset_id"]) for i in range(200))
    assert abs(share[0] / 200 - 0.8) < 0.03, share
    sample = train[0]
    assert sample["tokens"].shape == (16,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    # Train and validation samples come from disjoint documents: no 16-token window is shared.
    windows = {tuple(train[i]["tokens"].tolist()) for i in range(len(train))}
    assert not any(tuple(valid[i]["tokens"].tolist()) in windows for i in range(len(valid)))


def test_a_split_without_documents_is_an_error(prefixes: list[str]) -> None:
    config = load_pretrain_config(
        None, [f"data.prefixes=[{prefixes[0]}]", "data.split=999,1,0", "model.vocab_size=128", "eval.interval=5"]
    )
    with pytest.raises(ConfigError, match="the validation split of .* gets none of its 120 documents"):
        build_datasets(config, 1, TokenIds(vocab_size=128, eod=0))


def test_reader_follows_megatrons_sampler() -> None:
    dataset = [
        {
            "tokens": torch.tensor([i]),
            "labels": torch.tensor([i]),
            "loss_mask": torch.ones(1),
            "position_ids": torch.zeros(1),
        }
        for i in range(100)
    ]
    # Global batch 12 = 2 microbatches x 3 sequences x 2 data-parallel ranks, from sample 24 on.
    got = {
        rank: [
            mb["tokens"].flatten().tolist()
            for mb in MicrobatchReader(dataset, 3, rank, 2, torch.device("cpu")).step(24, 2)
        ]
        for rank in (0, 1)
    }
    assert got == {0: [[24, 25, 26], [30, 31, 32]], 1: [[27, 28, 29], [33, 34, 35]]}
