"""``pretrain`` at TP2 (+SP), PP2, PP2 x VPP2 and DP2 reproduces the single-rank run's losses.

One rank writes the initial weights of the tiny model (a run of 0 steps that saves its
checkpoint) and trains 4 steps from them: the reference. Two ranks then train the same 4
steps at each layout, starting from that checkpoint (megatron's dist_checkpointing reshards
it; pipeline stages could not reproduce the single-rank random init on their own). Every
step's loss, learning rate and gradient norm must match within fp32 tolerance: data order,
gradient accumulation (4 microbatches of 2 sequences, or 2 per data-parallel rank), loss
reduction, clipping and the schedule all agree. Data are two blended indexed datasets.

In the same group: PP2 with noop layers (``model.num_layers=6``, ``model.noop_layers=0,1``:
megatron's pipeline layout puts 1 real layer on stage 0 and 3 on stage 1) trains the same 4-layer
model from the same checkpoint, so it matches the reference like every layout, and its Hugging
Face export holds the reference's 4 layers and weights (1e-5); and TP2 with
``train.deterministic`` runs twice: the two runs' records and final weights are bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

STEPS = 4
DETERMINISTIC = "tp2-deterministic"
LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "dp2-distopt": ["parallel.distributed_optimizer=true"],
    "pp2-noop": ["parallel.pp=2", "model.num_layers=6", "model.noop_layers=0,1"],
    "tp2-deterministic": ["parallel.tp=2", "train.deterministic=true"],
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


def _run(data: dict[str, str], *extra: str, after_train: Any = None) -> list[dict[str, Any]]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import TrainerHooks, pretrain

    result = pretrain(load_pretrain_config(None, _overrides(data, *extra)), TrainerHooks(after_train=after_train))
    return [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in result.records]


def _keep_weights(into: dict[str, Any]) -> Any:
    from mindspeed_llm.training.model import unwrap

    def keep(chunks: list[Any]) -> None:
        for i, chunk in enumerate(chunks):
            into.update(
                {f"{i}.{k}": v.detach().clone() for k, v in unwrap(chunk).state_dict().items() if v is not None}
            )

    return keep


def _reference(rank: int, world_size: int, data: dict[str, str], init: str) -> list[dict[str, Any]]:
    _run(data, "train.steps=0", f"checkpoint.save={init}")
    hf = f"checkpoint.save_hf={init}-hf-reference"
    return _run(data, f"train.steps={STEPS}", f"checkpoint.load={init}", "checkpoint.finetune=true", hf)


def _compare_exports(reference: str, noop: str) -> dict[str, Any]:
    """Tensor names and the largest difference of two Hugging Face exports."""
    from safetensors.torch import load_file

    def tensors(directory: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            out.update(load_file(path))
        return out

    ref, got = tensors(reference), tensors(noop)
    same = sorted(ref) == sorted(got)
    diff = max((ref[k].float() - got[k].float()).abs().max().item() for k in ref) if same else None
    return {"names": sorted(got), "same_names": same, "max_diff": diff}


def _layouts(rank: int, world_size: int, data: dict[str, str], init: str) -> dict[str, Any]:
    import torch

    from mindspeed_llm.training.model import unwrap

    start = (f"train.steps={STEPS}", f"checkpoint.load={init}", "checkpoint.finetune=true")
    stage_layers: list[int] = []

    def count_layers(chunks: list[Any]) -> None:
        stage_layers.extend(len(unwrap(chunk).decoder.layers) for chunk in chunks)

    out: dict[str, Any] = {
        name: _run(data, *start, *extra, f"checkpoint.save_hf={init}-hf-noop", after_train=count_layers)
        if name == "pp2-noop"
        else _run(data, *start, *extra)
        for name, extra in LAYOUTS.items()
        if name != DETERMINISTIC
    }
    first: dict[str, Any] = {}
    second: dict[str, Any] = {}
    out[DETERMINISTIC] = _run(data, *start, *LAYOUTS[DETERMINISTIC], after_train=_keep_weights(first))
    again = _run(data, *start, *LAYOUTS[DETERMINISTIC], after_train=_keep_weights(second))
    out["probes"] = {
        "records": again == out[DETERMINISTIC],
        "weights": sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first),
        "tensors": len(first),
        "rank": rank,
        "noop_stage_layers": stage_layers,
        "noop_export": _compare_exports(f"{init}-hf-reference", f"{init}-hf-noop"),
    }
    return out


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
    again = [ranked.pop("probes") for ranked in layouts]
    assert layouts[0] == layouts[1], "ranks disagree on the logged metrics"
    layouts[0]["probes"] = again
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


@pytest.mark.distributed
def test_noop_layers_place_the_real_layers_unevenly_and_export_without_them(runs: tuple[list, dict]) -> None:
    # noop layers 0 and 1 of 6 at PP2: stage 0 holds layer 2 only, stage 1 layers 3-5.
    assert [rank["noop_stage_layers"] for rank in runs[1]["probes"]] == [[1], [3]]
    # The Hugging Face export holds the 4 real layers, as the reference's does, with its weights.
    export = runs[1]["probes"][0]["noop_export"]
    assert export["same_names"] and any("layers.3." in name for name in export["names"]), export["names"]
    assert not any("layers.4." in name for name in export["names"])
    assert export["max_diff"] < 1e-5, export["max_diff"]


@pytest.mark.distributed
def test_deterministic_runs_are_bit_identical(runs: tuple[list, dict]) -> None:
    for rank in runs[1]["probes"]:
        assert rank["records"], f"rank {rank['rank']}: the second deterministic run logged other numbers"
        assert rank["tensors"] > 0 and rank["weights"], f"rank {rank['rank']}: final weights differ"
