"""Data parallel (DDP + distributed optimizer) and expert parallel on gloo ranks match one rank.

One spawned group of 2 ranks checks:

- data parallel 2 with megatron's ``DistributedDataParallel`` and ``DistributedOptimizer``
  (Adam, gradient clipping), ``overlap_grad_reduce`` off and on, against the single-rank run
  with the plain (non-distributed) optimizer on the full batch: loss and gradient norm of
  every step and all parameters after the last step;
- MoE (4 SequentialMLP experts, top-2, aux loss coefficient 0) with expert parallel 2, for the
  alltoall and the allgather token dispatchers: loss and every gradient, experts included.
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from mindspeed.testing.megatron import (
    Comparison,
    ParallelSizes,
    TinyGPTConfig,
    broadcast_state,
    build_gpt,
    check_layout,
    compare_with_full,
    destroy_parallel,
    full_state,
    init_parallel,
    load_full_state,
    local_batches,
    make_batches,
    merge_summaries,
    run_reference,
    train_step,
)

DENSE = TinyGPTConfig(num_layers=2)
NUM_STEPS, NUM_MICROBATCHES, MICRO_BATCH_SIZE = 3, 2, 4
LR = 1e-3
#: Below the first gradient norms (about 0.8), so clipping scales every step: the global norm
#: over the distributed optimizer's shards must be right for the parameters to match.
CLIP_GRAD = 0.5
#: label -> DistributedDataParallelConfig fields of the layout under test.
DP_LAYOUTS = {
    "dp2-distopt": dict(use_distributed_optimizer=True),
    # Small buckets: several gradient reductions start during the backward.
    "dp2-distopt-overlap-grad-reduce": dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=4096),
}
MOE_LAYOUTS = {
    f"ep2-{dispatcher}": TinyGPTConfig(
        num_layers=2, num_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher
    )
    for dispatcher in ("alltoall", "allgather")
}


def _optimizer(chunks: list[Any], distributed: bool) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=LR, clip_grad=CLIP_GRAD, use_distributed_optimizer=distributed)
    return get_megatron_optimizer(config, chunks)


def _check_data_parallel() -> list[dict[str, Any]]:
    from megatron.core.distributed import DistributedDataParallelConfig

    steps = [make_batches(DENSE, NUM_MICROBATCHES, MICRO_BATCH_SIZE, seed=step) for step in range(NUM_STEPS)]
    # Reference: every rank runs the whole batch with the plain optimizer; megatron's DDP
    # averages identical gradients over the world, so this is the single-rank run.
    init_parallel(ParallelSizes(), DENSE.seed)
    chunks = build_gpt(DENSE, ParallelSizes())
    broadcast_state(chunks)
    initial = full_state(chunks)
    optimizer = _optimizer(chunks, distributed=False)
    reference = [train_step(chunks, optimizer, batches) for batches in steps]
    final = full_state(chunks)
    destroy_parallel()
    summaries = []
    for label, ddp_fields in DP_LAYOUTS.items():
        init_parallel(ParallelSizes(), DENSE.seed)
        chunks = build_gpt(DENSE, ParallelSizes(), DistributedDataParallelConfig(**ddp_fields))
        load_full_state(chunks, DENSE, initial)
        optimizer = _optimizer(chunks, distributed=True)
        # Each rank takes half of every microbatch; DDP divides gradients by the DP size
        # before summing them, which gives the full batch's mean gradient again.
        history = [train_step(chunks, optimizer, local_batches(batches)) for batches in steps]
        comparison = Comparison(label)
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, reference)):
            comparison.add(f"step {step} loss", loss, ref_loss, atol=1e-5, rtol=1e-6)
            comparison.add(f"step {step} grad norm", norm, ref_norm, atol=1e-6, rtol=1e-5)
        compare_with_full(chunks, DENSE, final, comparison, read=lambda p: p, prefix="param")
        comparison.extra.update(
            reference_names=sorted(final),
            grad_norms=[norm for _, norm in reference],
            reference_moved=min((final[name] - initial[name]).abs().max().item() for name in final),
            # get_megatron_optimizer returns a ChainedOptimizer around the per-group optimizers.
            optimizers=sorted({type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])}),
            num_buckets=sum(len(chunk.bucket_groups) for chunk in chunks),
        )
        summaries.append(comparison.summary())
        destroy_parallel()
    return summaries


def _check(rank: int, world_size: int) -> dict[str, Any]:
    from mindspeed.megatron import adapt, unadapt

    adapt()
    try:
        summaries = _check_data_parallel()
        names, zero = {}, []
        for label, model in MOE_LAYOUTS.items():
            batches = make_batches(model, NUM_MICROBATCHES, MICRO_BATCH_SIZE)
            reference = run_reference(model, batches)
            names[label] = sorted(reference.grads)
            zero += [f"{label}: {name}" for name, grad in reference.grads.items() if not grad.any()]
            # Expert gradients: every EP rank's experts see tokens of both data-parallel ranks;
            # DDP scales expert gradients by 1 / DP size as well, so they come out as the
            # full-batch mean gradients of the single-rank run.
            summaries.append(check_layout(model, ParallelSizes(ep=2), batches, reference, label))
    finally:
        unadapt()
    return {"summaries": summaries, "moe_names": names, "moe_zero_grads": zero}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    per_rank = run_distributed(_check, 2, timeout=600)
    return {
        "layouts": merge_summaries([out["summaries"] for out in per_rank]),
        "moe_names": per_rank[0]["moe_names"],
        "moe_zero_grads": per_rank[0]["moe_zero_grads"],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(DP_LAYOUTS))
def test_distributed_optimizer_matches_single_rank(results: dict[str, Any], label: str) -> None:
    layout = results["layouts"][label]
    assert layout["optimizers"] == ["DistributedOptimizer"]
    assert not layout["failures"], f"{label} differs from the single-rank run:\n" + "\n".join(layout["failures"])
    expected = {f"param {name}" for name in layout["reference_names"]}
    assert expected <= layout["names"], f"{label}: not compared {sorted(expected - layout['names'])}"
    assert layout["reference_moved"] > 0, "a reference parameter did not change: the comparison proves little"
    assert min(layout["grad_norms"]) > CLIP_GRAD, "gradient clipping was not exercised at every step"
    if "bucket_size" in DP_LAYOUTS[label]:
        assert layout["num_buckets"] > 1, "one bucket: no reduction overlapped the backward"


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(MOE_LAYOUTS))
def test_expert_parallel_matches_single_rank(results: dict[str, Any], label: str) -> None:
    layout = results["layouts"][label]
    assert layout["schedule"] == "forward_backward_no_pipelining"
    assert not layout["failures"], f"{label} differs from the single-rank run:\n" + "\n".join(layout["failures"])
    expected = {"loss"} | {f"grad {name}" for name in results["moe_names"][label]}
    assert layout["names"] == expected, f"{label}: not compared {sorted(expected - layout['names'])}"
    assert any(".experts.local_experts.3." in name for name in layout["names"])
    # Every expert got tokens in the reference, so matching expert gradients on both EP ranks
    # means tokens really crossed between the ranks.
    assert not [name for name in results["moe_zero_grads"] if name.startswith(label)]
