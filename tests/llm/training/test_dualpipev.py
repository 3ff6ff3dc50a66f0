"""DualPipeV (``features.settings.dualpipev.enabled=true``) trains as megatron's 1F1B and as one rank.

One rank writes the tiny model's initial weights (a run of 0 steps that saves) and trains 3
steps from them: the reference. Then, from that checkpoint, each layout trains the same 3 steps
with megatron's 1F1B and with DualPipeV: PP2 on 2 ranks; PP4, PP2 x TP2 (sequence parallel) and
PP2 x DP2 (distributed optimizer) on 4 ranks. Every step's loss and gradient norm, and the
evaluation after step 3 (the V's forward-only pass), must match the reference's and 1F1B's
(fp32: 1e-6 absolute on the loss, 1e-6 relative on the norm: the reductions over pipeline ranks
add in another order), and the final weights of DualPipeV and 1F1B must be equal within 1e-6.
Each DualPipeV run reports the V's global layer numbers (rank r: chunks r and 2P-1-r), and the
PP2 run saves after step 2: a DualPipeV run resuming from it, and a 1F1B run (the checkpoint
holds megatron's usual layer numbering), log the uninterrupted run's step 3.

A tiny MoE GPT with tied embeddings (4 experts, top-2, megatron's load-balancing loss, all-to-all dispatch) trains the
same way at PP2 (2 ranks) and PP2 x EP2 (4 ranks) against its own one-rank run; megatron's
per-layer auxiliary-loss tracker (keyed by global layer number) and the expert-load metrics
(``moe_expert_load_metrics``: tokens per expert per layer) must match 1F1B's too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

STEPS = 3
LAYERS = 8
DPV = "features.settings.dualpipev.enabled=true"
MOE = (
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_token_dispatcher_type=alltoall",
    "features.settings.moe_expert_load_metrics.enabled=true",
    # Tied too: rank 0 holds the embedding (chunk 0) and the output layer (chunk 1); no run of its own.
    "model.tie_embeddings=true",
)


def _overrides(data: str, *extra: str) -> list[str]:
    return [
        f"data.prefixes=[{data}]",
        "data.seq_length=32",
        "data.split=90,10,0",
        "model.vocab_size=128",
        f"model.num_layers={LAYERS}",
        "model.hidden_size=64",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=128",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
        "train.lr=3e-3",
        "train.lr_warmup_init=1e-3",
        "train.lr_warmup_steps=1",
        "train.clip_grad=0.5",
        "eval.interval=3",
        "eval.iters=1",
        "logging.progress=false",
        *extra,
    ]


def _run(data: str, *extra: str, weights: dict[str, Any] | None = None, layers: list | None = None) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from mindspeed.metrics.moe import ExpertLoadTracker
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.model import unwrap
    from mindspeed_llm.training.trainer import TrainerHooks, pretrain

    def after(chunks: list[Any]) -> None:
        tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        get_moe_layer_wise_logging_tracker().clear()
        for chunk in chunks:
            gpt = unwrap(chunk)
            if layers is not None:
                layers.append([layer.layer_number - 1 for layer in gpt.decoder.layers])
            if weights is None:
                continue
            # Keyed by TP rank and global layer number: the two schedules place the layers differently.
            for name, value in gpt.state_dict().items():
                if value is None or "_extra_state" in name:
                    continue
                if name.startswith("decoder.layers."):
                    index, rest = name[len("decoder.layers.") :].split(".", 1)
                    name = f"layer{gpt.decoder.layers[int(index)].layer_number - 1}.{rest}"
                if ".experts." in name:  # expert-parallel ranks hold other experts
                    name = f"ep{ep}.{name}"
                weights[f"tp{tp}.{name}"] = value.detach().clone()

    aux: dict[str, list[float]] = {}
    loads: list[dict[int, list[int]]] = []
    log_step = ExpertLoadTracker.log_step

    def record(self: ExpertLoadTracker, step: int) -> Any:
        load = log_step(self, step)
        if load is not None:
            loads.append(load.counts)
        return load

    reduce = moe_utils.reduce_aux_losses_tracker_across_ranks

    def snapshot(names: Any = None, *args: Any, **kwargs: Any) -> None:
        # megatron's per-layer auxiliary losses of the run (this rank's layers, summed over its microbatches and
        # steps), taken before the trainer's per-step read (mindspeed.metrics.moe) reduces them over the stages.
        tracker = get_moe_layer_wise_logging_tracker()
        for name in names if names is not None else list(tracker):
            values = tracker[name]["values"].tolist()
            aux[name] = [a + b for a, b in zip(aux.get(name, [0.0] * len(values)), values)]
        reduce(names, *args, **kwargs)

    ExpertLoadTracker.log_step = record  # this spawned rank only: the tokens per expert of each step
    moe_utils.reduce_aux_losses_tracker_across_ranks = snapshot
    try:
        result = pretrain(load_pretrain_config(None, _overrides(data, *extra)), TrainerHooks(after_train=after))
    finally:
        ExpertLoadTracker.log_step = log_step
        moe_utils.reduce_aux_losses_tracker_across_ranks = reduce
    return {
        "aux": aux,
        "expert_load": loads,
        "records": [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in result.records],
        "logged_aux": [r.get("load_balancing_loss") for r in result.records],
        "evals": [e["loss"] for e in result.evals],
        "features": result.features.get("order", []),
        "step_time_s": [r["step_time_s"] for r in result.records],
    }


def _reference(rank: int, world_size: int, data: str, init: str) -> dict[str, Any]:
    out = {}
    for model, extra in (("dense", ()), ("moe", MOE)):
        start = f"{init}-{model}"
        _run(data, "train.steps=0", f"checkpoint.save={start}", *extra)
        out[model] = _run(data, f"train.steps={STEPS}", f"checkpoint.load={start}", "checkpoint.finetune=true", *extra)
    return out


def _layouts(rank: int, world_size: int, data: str, init: str, root: str, layouts: dict[str, list[str]]) -> dict:
    out: dict[str, Any] = {}
    for name, extra in layouts.items():
        model = "moe" if name.startswith("moe") else "dense"
        start = (f"train.steps={STEPS}", f"checkpoint.load={init}-{model}", "checkpoint.finetune=true")
        plain: dict[str, Any] = {}
        dual: dict[str, Any] = {}
        layers: list[list[int]] = []
        save = (f"checkpoint.save={root}/{name}-dpv", "checkpoint.interval=2", "checkpoint.save_at_end=false")
        save = save if name == "pp2" else ()
        out[name] = {
            "1f1b": _run(data, *start, *extra, weights=plain),
            "dualpipev": _run(data, *start, *extra, DPV, *save, weights=dual, layers=layers),
            "weights": (plain, dual),
            "layers": layers,
        }
        if save:
            resume = (f"train.steps={STEPS}", f"checkpoint.load={root}/{name}-dpv")
            out[name]["resumed_dualpipev"] = _run(data, *resume, *extra, DPV)
            out[name]["resumed_1f1b"] = _run(data, *resume, *extra)
    return out


def _merge(ranks: list[dict[str, Any]], name: str, which: int) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for rank in ranks:
        merged.update(rank[name]["weights"][which])
    return merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("dualpipev")
    data = write_indexed_dataset(root / "data" / "a", 200, seed=1)
    init = str(root / "init")
    (reference,) = run_distributed(_reference, 1, data, init, timeout=600)
    ranks = run_distributed(_layouts, 2, data, init, str(root), TWO_RANKS, timeout=900)
    ranks += run_distributed(_layouts, 4, data, init, str(root), FOUR_RANKS, timeout=900)
    out: dict[str, Any] = {"reference": reference, "layouts": {}, "tied": {}}
    for name in (*TWO_RANKS, *FOUR_RANKS):
        group = [r for r in ranks if name in r]
        plain, dual = _merge(group, name, 0), _merge(group, name, 1)
        out["tied"][name] = [
            (weights[f"tp{tp}.embedding.word_embeddings.weight"], weights[f"tp{tp}.output_layer.weight"])
            for weights in (r[name]["weights"][1] for r in group)
            for tp in range(2)
            if f"tp{tp}.output_layer.weight" in weights and f"tp{tp}.embedding.word_embeddings.weight" in weights
        ]
        same = sorted(plain) == sorted(dual)
        out["layouts"][name] = {
            **{k: v for k, v in group[0][name].items() if k != "weights"},
            "ranks": [{k: v for k, v in r[name].items() if k != "weights"} for r in group],
            "tensors": len(plain),
            "weights_diff": max((plain[k] - dual[k]).abs().max().item() for k in plain) if same else None,
        }
        got = out["layouts"][name]
        records = reference["moe" if name.startswith("moe") else "dense"]["records"]
        pairs = list(zip(records, got["1f1b"]["records"], got["dualpipev"]["records"]))
        # The proof table of docs/core/dualpipev.md (shown with pytest -s).
        print(
            f"dualpipev {name}: max |loss - 1F1B| {max(abs(d['loss'] - p['loss']) for _, p, d in pairs):.2e}, "
            f"|loss - 1 rank| {max(abs(d['loss'] - o['loss']) for o, _, d in pairs):.2e}, "
            f"grad-norm rel vs 1F1B {max(abs(d['grad_norm'] / p['grad_norm'] - 1) for _, p, d in pairs):.2e}, "
            f"vs 1 rank {max(abs(d['grad_norm'] / o['grad_norm'] - 1) for o, _, d in pairs):.2e}, "
            f"weights vs 1F1B {got['weights_diff']:.2e} over {got['tensors']} tensors"
        )
    return out


TWO_RANKS = {"pp2": ["parallel.pp=2"], "moe-pp2": ["parallel.pp=2", *MOE]}
FOUR_RANKS = {
    "pp4": ["parallel.pp=4"],
    "pp2-tp2-sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2-dp2-distopt": ["parallel.pp=2", "parallel.distributed_optimizer=true"],
    "moe-pp2-ep2": ["parallel.pp=2", "parallel.ep=2", *MOE],
}
PP = {"pp2": 2, "pp4": 4, "pp2-tp2-sp": 2, "pp2-dp2-distopt": 2, "moe-pp2": 2, "moe-pp2-ep2": 2}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PP))
def test_dualpipev_matches_1f1b_and_one_rank(runs: dict[str, Any], layout: str) -> None:
    reference = runs["reference"]["moe" if layout.startswith("moe") else "dense"]
    ref, got = reference["records"], runs["layouts"][layout]
    assert ref[-1]["loss"] < ref[0]["loss"], "the reference did not learn: the check would be vacuous"
    for rank in got["ranks"]:  # every rank logs the same, reduced numbers
        assert rank["dualpipev"]["records"] == got["dualpipev"]["records"]
    assert "dualpipev" in got["dualpipev"]["features"] and "dualpipev" not in got["1f1b"]["features"]
    for one, plain, dual in zip(ref, got["1f1b"]["records"], got["dualpipev"]["records"]):
        step = one["step"]
        assert dual["step"] == plain["step"] == step
        assert abs(dual["loss"] - plain["loss"]) < 1e-6 and abs(dual["loss"] - one["loss"]) < 1e-6, (layout, step)
        assert dual["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6), (layout, step)
        assert dual["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6), (layout, step)
    # The evaluation after step 3 runs the V forward-only.
    (one,), (plain,), (dual,) = reference["evals"], got["1f1b"]["evals"], got["dualpipev"]["evals"]
    assert abs(dual - plain) < 1e-6 and abs(dual - one) < 1e-6, (layout, dual, plain, one)
    assert got["tensors"] > 0 and got["weights_diff"] is not None, "the layouts hold other tensors"
    assert got["weights_diff"] < 1e-6, f"{layout}: final weights differ by {got['weights_diff']}"
    if "model.tie_embeddings=true" in FOUR_RANKS.get(layout, TWO_RANKS.get(layout)):
        # Rank 0's two copies of the tied embedding (chunk 0's input, chunk 1's output layer) stay equal.
        weights = runs["tied"][layout]
        assert weights and all(torch.equal(embedding, output) for embedding, output in weights), layout


def _sum_aux(ranks: list[dict[str, Any]], schedule: str) -> dict[str, list[float]]:
    total: dict[str, list[float]] = {}
    for rank in ranks:
        for name, values in rank[schedule]["aux"].items():
            total[name] = [a + b for a, b in zip(total.get(name, [0.0] * len(values)), values)]
    return total


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in PP if name.startswith("moe")])
def test_moe_aux_losses_and_expert_load_match(runs: dict[str, Any], layout: str) -> None:
    # megatron's aux-loss tracker is keyed by global layer number; the V's chunks carry those numbers.
    reference, got = runs["reference"]["moe"], runs["layouts"][layout]
    (one,) = reference["aux"].values()
    plain, dual = _sum_aux(got["ranks"], "1f1b"), _sum_aux(got["ranks"], "dualpipev")
    assert sorted(plain) == sorted(dual) == ["load_balancing_loss"], (plain, dual)
    assert len(one) == LAYERS and all(value > 0 for value in one), "no aux loss on some layer: a vacuous check"
    for name in plain:
        assert dual[name] == pytest.approx(plain[name], rel=1e-5), (layout, name)
        assert dual[name] == pytest.approx(one, rel=1e-5), (layout, name)
    # The value each train record logs (reduced over the stages, megatron's per-layer mean), on every rank.
    logged = reference["logged_aux"]
    assert len(logged) == STEPS and all(value > 0 for value in logged), logged
    for rank in got["ranks"]:
        for schedule in ("1f1b", "dualpipev"):
            assert rank[schedule]["logged_aux"] == pytest.approx(logged, rel=1e-5), (layout, schedule)
    # Tokens per expert per layer and step (collected over all ranks), as the logs print them.
    loads = got["ranks"][0]["dualpipev"]["expert_load"]
    assert len(loads) == STEPS and sorted(loads[0]) == list(range(1, LAYERS + 1)), loads
    assert loads == got["ranks"][0]["1f1b"]["expert_load"] == reference["expert_load"], layout


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PP))
def test_each_rank_holds_the_v(runs: dict[str, Any], layout: str) -> None:
    p, n = PP[layout], LAYERS // (2 * PP[layout])
    got = [rank["layers"] for rank in runs["layouts"][layout]["ranks"]]
    tp = len(got) // p  # ranks are ordered TP-fastest
    expected = [[list(range(r * n, (r + 1) * n)), list(range((2 * p - 1 - r) * n, (2 * p - r) * n))] for r in range(p)]
    assert got == [expected[i // tp] for i in range(len(got))]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dualpipev_checkpoint_resumes_under_both_schedules(runs: dict[str, Any]) -> None:
    got = runs["layouts"]["pp2"]
    last = got["dualpipev"]["records"][-1]
    for schedule in ("resumed_dualpipev", "resumed_1f1b"):
        (record,) = got[schedule]["records"]
        assert record["step"] == last["step"] == STEPS
        assert abs(record["loss"] - last["loss"]) < 1e-6, (schedule, record, last)
        assert record["grad_norm"] == pytest.approx(last["grad_norm"], rel=1e-6), schedule


def test_runners_on_megatron_schedules_refuse_the_v() -> None:
    # A runner on megatron's schedules (PPO's critic) refuses the feature at build time.
    from types import SimpleNamespace

    from mindspeed_llm.training.build import BuildSpec, build_engine

    report = SimpleNamespace(kernels={}, hooks={}, features=SimpleNamespace(enabled=["dualpipev"]))
    spec = BuildSpec(shape=None, parallel=None, vocab=0, transformer=None)
    with pytest.raises(ValueError, match=r"this runner runs megatron's own schedules.*dualpipev.enabled=false"):
        build_engine(spec, report, groups=None)
