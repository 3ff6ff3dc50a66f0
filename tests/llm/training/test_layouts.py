"""``pretrain`` at TP2 (+SP), PP2, PP2 x VPP2 and DP2 reproduces the single-rank run's losses.

One rank writes the initial weights of the tiny model (a run of 0 steps that saves its
checkpoint) and trains 4 steps from them: the reference. Two ranks then train the same 4
steps at each layout, starting from that checkpoint (megatron's dist_checkpointing reshards
it; pipeline stages could not reproduce the single-rank random init on their own). Every
step's loss, learning rate and gradient norm must match within fp32 tolerance: data order,
gradient accumulation (4 microbatches of 2 sequences, or 2 per data-parallel rank), loss
reduction, clipping and the schedule all agree. Data are two blended indexed datasets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

STEPS = 4
LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "dp2-distopt": ["parallel.distributed_optimizer=true"],
}


def _overrides(data: dict[str, str], *extra: str) -> list[str]:
    return [
        f"data.prefixes=[{data['a']},{data['b']}]",
        "data.weights=[0.6,0.4]",
        "data.seq_length=32",
        "data.split=90,10,0",
        "model.vocab_size=128",
        "model.num_layers=4",
        "model.hidden_size=64",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=128",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.lr=3e-3",
        "train.lr_warmup_init=1e-3",
        "train.lr_warmup_steps=1",
        "train.clip_grad=0.5",
        "logging.progress=false",
        *extra,
    ]


def _run(data: dict[str, str], *extra: str) -> list[dict[str, Any]]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    result = pretrain(load_pretrain_config(None, _overrides(data, *extra)))
    return [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in result.records]


def _reference(rank: int, world_size: int, data: dict[str, str], init: str) -> list[dict[str, Any]]:
    _run(data, "train.steps=0", f"checkpoint.save={init}")
    return _run(data, f"train.steps={STEPS}", f"checkpoint.load={init}", "checkpoint.finetune=true")


def _layouts(rank: int, world_size: int, data: dict[str, str], init: str) -> dict[str, list[dict[str, Any]]]:
    return {
        name: _run(data, f"train.steps={STEPS}", f"checkpoint.load={init}", "checkpoint.finetune=true", *extra)
        for name, extra in LAYOUTS.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    root: Path = tmp_path_factory.mktemp("layouts")
    data = {
        "a": write_indexed_dataset(root / "data" / "a", 160, seed=1),
        "b": write_indexed_dataset(root / "data" / "b", 90, seed=2),
    }
    init = str(root / "init")
    (reference,) = run_distributed(_reference, 1, data, init, timeout=600)
    layouts = run_distributed(_layouts, 2, data, init, timeout=900)
    assert layouts[0] == layouts[1], "ranks disagree on the logged metrics"
    return reference, layouts[0]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(runs: tuple[list, dict], layout: str) -> None:
    reference, layouts = runs
    got = layouts[layout]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert reference[-1]["loss"] < reference[0]["loss"], "the reference did not learn: the check would be vacuous"
    for ref, run in zip(reference, got):
        assert run["lr"] == pytest.approx(ref["lr"], rel=1e-12), f"{layout} step {ref['step']}: lr"
        assert abs(run["loss"] - ref["loss"]) < 1e-6, (
            f"{layout} step {ref['step']}: loss {run['loss']} vs {ref['loss']}"
        )
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6), f"{layout} step {ref['step']}"
