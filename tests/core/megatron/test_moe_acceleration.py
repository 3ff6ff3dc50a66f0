"""MoE acceleration on gloo ranks: 5 training steps of a tiny MoE GPT match the single-rank run.

One spawned group of 2 ranks. The reference is megatron-core's own model (local spec,
``SequentialMLP`` experts, megatron's activation, no features) with shared experts, the
aux-loss load balancing and aux-loss-free expert-bias balancing, trained 5 Adam steps on
every rank with the whole batch. Each layout is built through ``adapt(features=...)``: the
features set the MoE config fields (shared experts, load balancing, expert bias, TP-extend-EP
layout), the spec provider builds grouped-matmul experts (``RegistryGroupedMLP``) and
registry kernels, and ``moe_permute_fusion`` patches the dispatcher's permutation:

- ``ep2-alltoall``: EP 2 (DP 2), alltoall dispatcher, grouped matmul, fused permute;
- ``ep2-allgather``: EP 2 (DP 2), allgather dispatcher, grouped matmul (the permute feature
  is off: it is not for allgather);
- ``tp2-extend-ep``: TP 2 with sequence parallelism, ``moe_tp_extend_ep`` (ETP 1, EP 2 over
  the TP ranks), alltoall, grouped matmul, fused permute;
- ``tp2-etp2``: the same without the extension: each grouped expert is split over the two
  tensor-parallel ranks (megatron's default ETP = TP).

Compared with the reference: the LM loss and the load-balancing loss of each step, every
gradient of the first step (experts mapped to the grouped layout and sliced by EP/ETP), the
gradient norm of each step, the router expert biases after the first and the last step,
every parameter after the last step, and the tokens per expert per layer of every step
logged by the ``moe_expert_load_metrics`` feature's hooks.

The auxiliary loss is computed per microbatch on each rank's rows; with 2 data-parallel
ranks the reference therefore runs every microbatch as its two halves (``split_microbatches``).
TP-extend-EP has one data-parallel rank (its sequence shards add up to the whole auxiliary
loss), so its reference runs whole microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from mindspeed.testing.megatron import (
    Comparison,
    ParallelSizes,
    TinyGPTConfig,
    broadcast_state,
    build_gpt,
    compare_with_full,
    destroy_parallel,
    expert_biases,
    full_grads,
    full_state,
    grouped_expert_state,
    init_parallel,
    load_full_state,
    local_batches,
    make_batches,
    merge_summaries,
    split_microbatches,
    train_steps,
    unwrap,
)

NUM_EXPERTS = 4
NUM_STEPS, NUM_MICROBATCHES, MICRO_BATCH_SIZE = 5, 2, 4
LR, CLIP_GRAD = 1e-3, 1.0
SHARED_SIZE, AUX_COEFF, BIAS_RATE = 64, 1e-2, 1e-2
#: The reference's config: what the features below must produce.
REFERENCE_FIELDS = dict(
    moe_shared_expert_intermediate_size=SHARED_SIZE,
    moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=AUX_COEFF,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=BIAS_RATE,
    moe_router_score_function="sigmoid",
)
MOE_SETTINGS = {
    "moe_grouped_gemm": True,
    "moe_shared_experts": {"enabled": True, "intermediate_size": SHARED_SIZE},
    "moe_load_balancing": {"enabled": True, "type": "aux_loss", "aux_loss_coeff": AUX_COEFF},
    "moe_router_expert_bias": {"enabled": True, "update_rate": BIAS_RATE},
    "moe_expert_load_metrics": {"enabled": True, "per_layer": True},
}


@dataclass(frozen=True)
class Layout:
    """One run under test: dispatcher, parallel sizes before the features, extra feature settings."""

    dispatcher: str
    tp: int = 1
    ep: int = 1
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def dp_parts(self) -> int:
        """Data-parallel ranks of the run on 2 processes (what the reference splits microbatches into)."""
        return 2 // self.tp


LAYOUTS = {
    "ep2-alltoall": Layout("alltoall", ep=2, settings={"moe_permute_fusion": True}),
    "ep2-allgather": Layout("allgather", ep=2),
    "tp2-extend-ep": Layout("alltoall", tp=2, settings={"moe_permute_fusion": True, "moe_tp_extend_ep": True}),
    # Without the extension: every expert is split over the 2 TP ranks (ETP 2).
    "tp2-etp2": Layout("alltoall", tp=2, settings={"moe_permute_fusion": True}),
}


def _model(dispatcher: str) -> TinyGPTConfig:
    return TinyGPTConfig(num_layers=2, num_experts=NUM_EXPERTS, moe_router_topk=2, moe_token_dispatcher_type=dispatcher)


def _optimizer(chunks: list[Any]) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, clip_grad=CLIP_GRAD), chunks)


def _reference(steps: list[list[dict]], dp_parts: int) -> dict[str, Any]:
    """megatron's own model trained on every rank with the whole batch (microbatches cut in dp_parts)."""
    from mindspeed.metrics.moe import ExpertLoadTracker

    model = _model("alltoall")
    init_parallel(ParallelSizes(), model.seed)
    try:
        chunks = build_gpt(model, ParallelSizes(), **REFERENCE_FIELDS)
        broadcast_state(chunks)
        initial = full_state(chunks)
        tracker = ExpertLoadTracker().attach(chunks)
        record: dict[str, Any] = {"counts": []}

        def after_backward(step: int) -> None:
            record["counts"].append(tracker.local_counts())  # this rank ran the whole batch
            tracker.reset()
            if step == 0:
                record["grads"] = grouped_expert_state(full_grads(chunks), NUM_EXPERTS)
                record["biases0"] = expert_biases(chunks)

        history = train_steps(
            chunks, _optimizer(chunks), [split_microbatches(b, dp_parts) for b in steps], after_backward
        )
        return {
            **record,
            "history": history,
            "initial": initial,
            "biases": expert_biases(chunks),
            "final": grouped_expert_state(full_state(chunks), NUM_EXPERTS),
        }
    finally:
        destroy_parallel()


def _run_layout(label: str, layout: Layout, steps: list[list[dict]], reference: dict[str, Any]) -> dict[str, Any]:
    from mindspeed.features import FeaturesConfig, ModelFacts
    from mindspeed.features import ParallelSizes as FeatureSizes
    from mindspeed.features.moe import EXPERT_LAYOUT_FIELDS, expert_layout
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.megatron.spec import get_gpt_layer_spec

    model = _model(layout.dispatcher)
    facts = ModelFacts(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        num_moe_experts=NUM_EXPERTS,
        moe_token_dispatcher_type=layout.dispatcher,
    )
    report = adapt(
        "cpu",
        features=FeaturesConfig(settings={**MOE_SETTINGS, **layout.settings}),
        model=facts,
        parallel=FeatureSizes(tp=layout.tp, ep=layout.ep, dp=2 // layout.tp),
    )
    try:
        ctx = report.context
        overrides = dict(ctx.config_overrides)
        ep, etp = expert_layout(overrides, layout.ep)
        sizes = ParallelSizes(tp=layout.tp, ep=ep, etp=etp, sequence_parallel=layout.tp > 1)
        fields = {name: value for name, value in overrides.items() if name not in EXPERT_LAYOUT_FIELDS}
        init_parallel(sizes, model.seed)
        chunks = build_gpt(
            model,
            sizes,
            layer_spec=get_gpt_layer_spec(report.kernels, num_experts=NUM_EXPERTS),
            use_te_activation_func=True,
            bias_activation_fusion=False,
            **fields,
        )
        load_full_state(chunks, model, grouped_expert_state(reference["initial"], NUM_EXPERTS))
        for hook in ctx.hooks["post_model_build"]:
            hook(chunks)
        comparison = Comparison(label)

        def after_backward(step: int) -> None:
            for hook in ctx.hooks["post_step"]:
                hook(step)
            if step == 0:
                compare_with_full(chunks, model, reference["grads"], comparison)
                for name, bias in expert_biases(chunks).items():
                    comparison.add(f"step 0 {name}", bias, reference["biases0"][name], atol=1e-7, rtol=0)

        history = train_steps(chunks, _optimizer(chunks), [local_batches(b) for b in steps], after_backward)
        ref = reference["history"]
        for step in range(NUM_STEPS):
            comparison.add(f"step {step} loss", history.losses[step], ref.losses[step], atol=1e-5, rtol=1e-6)
            for name, value in ref.aux_losses[step].items():
                comparison.add(
                    f"step {step} {name}", history.aux_losses[step].get(name, float("nan")), value, atol=1e-6, rtol=1e-5
                )
            comparison.add(
                f"step {step} grad norm", history.grad_norms[step], ref.grad_norms[step], atol=1e-6, rtol=1e-5
            )
        for name, bias in expert_biases(chunks).items():
            comparison.add(f"final {name}", bias, reference["biases"][name], atol=1e-7, rtol=0)
        compare_with_full(chunks, model, reference["final"], comparison, read=lambda p: p, prefix="param")
        tracker = ctx.hooks["post_step"][0].__self__
        logged = [load.counts for load in tracker.history]
        comparison.extra.update(
            sizes=sizes.name,
            patches=[p.name for p in report.patches],
            enabled=report.features.enabled,
            experts=sorted(
                {type(m).__name__ for c in chunks for m in unwrap(c).modules() if "MLP" in type(m).__name__}
            ),
            counts=logged,
            reference_counts=reference["counts"],
            aux=[a for a in history.aux_losses],
            grad_norms=history.grad_norms,
            reference_names=sorted(reference["final"]),
        )
        return comparison.summary()
    finally:
        destroy_parallel()
        unadapt()


def _check(rank: int, world_size: int) -> dict[str, Any]:
    from mindspeed.megatron import adapt, unadapt

    steps = [
        make_batches(_model("alltoall"), NUM_MICROBATCHES, MICRO_BATCH_SIZE, seed=step) for step in range(NUM_STEPS)
    ]
    adapt("cpu")
    try:
        references = {
            parts: _reference(steps, parts) for parts in sorted({layout.dp_parts for layout in LAYOUTS.values()})
        }
    finally:
        unadapt()
    summaries = [_run_layout(label, layout, steps, references[layout.dp_parts]) for label, layout in LAYOUTS.items()]
    moved = {
        parts: min(
            (ref["final"][n] - grouped_expert_state(ref["initial"], NUM_EXPERTS)[n]).abs().max().item()
            for n in ref["final"]
        )
        for parts, ref in references.items()
    }
    bias_moved = {parts: max(b.abs().max().item() for b in ref["biases"].values()) for parts, ref in references.items()}
    return {"summaries": summaries, "moved": moved, "bias_moved": bias_moved}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    per_rank = run_distributed(_check, 2, timeout=600)
    return {"layouts": merge_summaries([out["summaries"] for out in per_rank]), **per_rank[0]}


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_moe_layout_trains_like_single_rank(results: dict[str, Any], label: str) -> None:
    layout = results["layouts"][label]
    assert not layout["failures"], f"{label} differs from the single-rank run:\n" + "\n".join(layout["failures"])
    names = layout["names"]
    expected = {f"param {name}" for name in layout["reference_names"]} | {
        f"grad {n}" for n in layout["reference_names"]
    }
    assert expected <= names, f"{label}: not compared {sorted(expected - names)}"
    assert {f"step {s} load_balancing_loss" for s in range(NUM_STEPS)} <= names, "aux loss not compared"
    assert any(name.startswith("final ") and name.endswith("expert_bias") for name in names)
    assert layout["experts"] == ["RegistryGroupedMLP", "SharedExpertMLP"], layout["experts"]
    assert layout["counts"] == layout["reference_counts"], "tokens per expert differ from the single-rank run"


@pytest.mark.distributed
def test_features_shape_each_layout(results: dict[str, Any]) -> None:
    layouts = results["layouts"]
    assert layouts["ep2-alltoall"]["sizes"] == "ep2"
    assert layouts["tp2-extend-ep"]["sizes"] == "tp2-sp-ep2-etp1", "moe_tp_extend_ep did not give EP 2 with ETP 1"
    assert layouts["tp2-etp2"]["sizes"] == "tp2-sp"
    for label in ("ep2-alltoall", "tp2-extend-ep", "tp2-etp2"):
        assert {"moe-permute-kernel", "moe-unpermute-kernel"} <= set(layouts[label]["patches"]), label
    assert "moe-permute-kernel" not in layouts["ep2-allgather"]["patches"]
    assert "moe_permute_fusion" not in layouts["ep2-allgather"]["enabled"]
    for layout in layouts.values():
        assert {"moe_grouped_gemm", "moe_shared_experts", "moe_load_balancing", "moe_router_expert_bias"} <= set(
            layout["enabled"]
        )


@pytest.mark.distributed
def test_reference_is_not_trivial(results: dict[str, Any]) -> None:
    # Every parameter moved, the biases moved, the aux loss was there, clipping was exercised.
    assert min(results["moved"].values()) > 0
    assert min(results["bias_moved"].values()) > BIAS_RATE / 2  # biases are multiples of the rate
    layout = results["layouts"]["ep2-alltoall"]
    assert all(step["load_balancing_loss"] > 0 for step in layout["aux"])
    assert max(layout["grad_norms"]) > 0
    counts = layout["counts"][0]
    assert len(counts) == 2 and all(sum(c) == NUM_MICROBATCHES * MICRO_BATCH_SIZE * 32 * 2 for c in counts.values())
