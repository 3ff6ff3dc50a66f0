"""EOD reset (``data.reset_attention_mask`` + ``data.reset_position_ids``) equals training the documents alone.

One rank writes a tiny model's initial weights, then runs ``pretrain`` from them with EOD reset
on 64-token samples of 20-80-token documents (so most samples hold pieces of two or three
documents). Before its first step, the same built trainer cuts the step's raw samples at every
end-of-document token and runs each document alone, as its own unpacked sequence, through the
model (forward only): the token-weighted mean of those losses must be the packed step's loss,
which the trainer then reports as step 1 (rel 1e-6). The same samples without the reset (one
causal sequence per sample) give a different loss, so the check has teeth. CP2 with the reset
is proven in ``test_context_parallel.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

COMMON = [
    "model.vocab_size=128",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "data.seq_length=64",
    "data.split=100,0,0",
    "data.eod_token_id=0",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=1e-3",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.loss_curve=false",
]
RESET = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


def _documents(batch: dict[str, Any], eod: int) -> list[dict[str, Any]]:
    """Every document piece of a ``[b, s]`` microbatch as its own ``[1, L]`` microbatch."""
    import torch

    docs = []
    for row in range(batch["tokens"].shape[0]):
        tokens = batch["tokens"][row]
        ends = [i + 1 for i in (tokens == eod).nonzero().flatten().tolist() if i + 1 < len(tokens)]
        for start, stop in zip([0, *ends], [*ends, len(tokens)]):
            docs.append(
                {key: batch[key][row : row + 1, start:stop] for key in ("tokens", "labels", "loss_mask")}
                | {"position_ids": torch.arange(stop - start).unsqueeze(0)}
            )
    return docs


def _group(rank: int, world_size: int, root: str, data: str) -> dict[str, Any]:
    import mindspeed_llm.training.trainer as trainer_module
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.steps import forward_backward

    found: dict[str, Any] = {}

    class Probe(trainer_module.Trainer):
        def train(self) -> Any:
            raw = self.train_reader.reader.step(0, self.config.num_microbatches(self.world))
            docs = [doc for batch in raw for doc in _documents(batch, self.ids.eod)]
            total = count = 0.0
            for doc in docs:
                loss, n = forward_backward(self.chunks, [doc], forward_only=True, groups=self.groups)
                total, count = total + loss * n, count + n
            found.update(alone=total / count, tokens=count, documents=len(docs), samples=2 * len(raw))
            found["packed"] = forward_backward(
                self.chunks, self.train_reader.step(0, len(raw)), forward_only=True, groups=self.groups
            )[0]
            found["unreset"] = forward_backward(self.chunks, raw, forward_only=True, groups=self.groups)[0]
            return super().train()

    init = f"{root}/init"
    trainer_module.pretrain(
        load_pretrain_config(None, [*COMMON, f"data.prefixes=[{data}]", "train.steps=0", f"checkpoint.save={init}"])
    )
    original, trainer_module.Trainer = trainer_module.Trainer, Probe
    try:
        result = trainer_module.pretrain(
            load_pretrain_config(
                None,
                [
                    *COMMON,
                    *RESET,
                    f"data.prefixes=[{data}]",
                    "train.steps=2",
                    f"checkpoint.load={init}",
                    "checkpoint.finetune=true",
                ],
            )
        )
    finally:
        trainer_module.Trainer = original
    found["step1"] = result.records[0]["loss"]
    found["step1_tokens"] = result.records[0]["tokens"]
    return found


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("eod")
    data = write_indexed_dataset(root / "data" / "docs", 60, seed=5)
    (result,) = run_distributed(_group, 1, str(root), data, timeout=600)
    return result


def test_packed_step_equals_documents_alone(found: dict[str, Any]) -> None:
    assert found["documents"] >= 2 * found["samples"], "the samples should hold several documents each"
    assert found["packed"] == pytest.approx(found["alone"], rel=1e-6)
    assert found["step1"] == pytest.approx(found["alone"], rel=1e-6)
    assert found["step1_tokens"] == found["tokens"]
    # Without the reset, later documents attend to earlier ones: a different loss.
    assert abs(found["unreset"] - found["alone"]) > 1e-3
