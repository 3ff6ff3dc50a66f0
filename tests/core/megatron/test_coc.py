"""Compute-communication overlap (the ``coc`` feature): the chunked pipelines equal the unfused pairs.

One spawned 2-rank gloo group checks, bit for bit in fp32 (``torch.equal``):

- the ops: ``all_gather_matmul`` and ``matmul_reduce_scatter``'s ``chunked`` kernels against their
  references (all-gather then GEMM; GEMM then reduce-scatter), output and the gradients of the
  input and the weight, for 1, 2, 3 and more chunks than rows (uneven chunks included);
- the model: the tiny GPT (2 layers) at TP2 + sequence parallelism built with the CoC linears
  (every QKV / projection / fc1 / fc2 through the chunked ops, counted) against the same model
  built with megatron's linears: the first step's gradients of every parameter and the losses
  of 3 optimizer steps.

The feature's one-line refusals (no TP, no sequence parallelism) are checked in-process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

LAYERS, STEPS = 2, 3


def _op_pairs(group: Any) -> list[str]:
    from mindspeed.ops import resolve_kernel

    problems = []
    rank = torch.distributed.get_rank()
    for op, rows in (("all_gather_matmul", 6), ("matmul_reduce_scatter", 12)):
        ref, chunked = resolve_kernel(op, "reference"), resolve_kernel(op, "chunked")
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(rows, 2, 16, generator=gen)
        w = torch.randn(12, 16, generator=gen)
        g = torch.randn(12 if op == "all_gather_matmul" else 6, 2, 12, generator=gen)
        expected = _run(ref, x, w, g, group, 1)
        for chunks in (1, 2, 4, 9):
            got = _run(chunked, x, w, g, group, chunks)
            for name, a, b in zip(("out", "dx", "dw"), expected, got):
                if not torch.equal(a, b):
                    problems.append(f"{op} chunks={chunks} {name}: max diff {(a - b).abs().max().item()}")
    return problems


def _run(fn: Any, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, group: Any, chunks: int) -> tuple:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w, group, chunks)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def _train(coc: bool) -> dict[str, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.testing.kernels import count_kernel_calls
    from mindspeed.testing.megatron import (
        ParallelSizes,
        TinyGPTConfig,
        build_gpt,
        destroy_parallel,
        global_loss,
        init_parallel,
        local_batches,
        local_grad,
        make_batches,
        run_forward_backward,
        train_step,
        unwrap,
    )

    kernels = {"all_gather_matmul": "chunked", "matmul_reduce_scatter": "chunked"} if coc else {}
    model = TinyGPTConfig(num_layers=LAYERS)
    sizes = ParallelSizes(tp=2, sequence_parallel=True)
    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(
            model, sizes, layer_spec=get_gpt_layer_spec({"attention": "reference", **kernels}, swiglu=False)
        )
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), chunks)
        steps = [local_batches(make_batches(model, 2, 2))] * STEPS
        with count_kernel_calls() as calls:
            optimizer.zero_grad()
            losses = [global_loss(run_forward_backward(chunks, steps[0]))]
            grads = {n: local_grad(p).clone() for c in chunks for n, p in unwrap(c).named_parameters()}
            optimizer.step()
            losses += [train_step(chunks, optimizer, batches)[0] for batches in steps[1:]]
        return {"losses": losses, "grads": grads, "calls": dict(calls)}
    finally:
        destroy_parallel()


def _group(rank: int, world_size: int) -> dict[str, Any]:
    import time

    from mindspeed.megatron import adapt, unadapt

    out: dict[str, Any] = {"ops": _op_pairs(torch.distributed.group.WORLD)}
    adapt("cpu")
    try:
        runs, timings = {}, {}
        for coc in (False, True):
            start = time.perf_counter()
            runs[coc] = _train(coc)
            timings[coc] = (time.perf_counter() - start) / STEPS
    finally:
        unadapt()
    plain, coc = runs[False], runs[True]
    # Compared here: tensors do not travel back from the ranks.
    out["losses"] = (plain["losses"], coc["losses"])
    out["grads"] = len(plain["grads"])
    out["grads_differ"] = {
        n: (g - coc["grads"][n]).abs().max().item()
        for n, g in plain["grads"].items()
        if not torch.equal(g, coc["grads"][n])
    }
    out["calls"] = (plain["calls"], coc["calls"])
    out["seconds_per_step"] = timings
    return out


@pytest.mark.distributed
def test_coc_equals_the_unfused_pairs_bit_for_bit() -> None:
    for out in run_distributed(_group, 2, timeout=300):
        assert out["ops"] == []
        plain_losses, coc_losses = out["losses"]
        assert coc_losses == plain_losses
        assert out["grads"] > 10 and out["grads_differ"] == {}
        plain_calls, coc_calls = out["calls"]
        # qkv + fc1 (proj + fc2) per layer, each forward of 2 microbatches x 3 steps
        assert coc_calls[("all_gather_matmul", "chunked")] == 2 * LAYERS * 2 * STEPS
        assert coc_calls[("matmul_reduce_scatter", "chunked")] == 2 * LAYERS * 2 * STEPS
        assert ("all_gather_matmul", "chunked") not in plain_calls
        print("coc losses", coc_losses, "seconds per step (off, on)", out["seconds_per_step"])


def test_feature_refuses_without_tp_and_sequence_parallel() -> None:
    from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features

    for tp, sp in ((1, True), (2, False)):
        ctx = BuildContext(parallel=ParallelSizes(tp=tp), model=ModelFacts(extra={"sequence_parallel": sp}))
        with pytest.raises(ValueError, match="feature 'coc'.*sequence_parallel=true"):
            apply_features(FeaturesConfig(settings={"coc": True}), ctx)
    ctx = BuildContext(parallel=ParallelSizes(tp=2), model=ModelFacts(extra={"sequence_parallel": True}))
    report = apply_features(FeaturesConfig(settings={"coc": {"enabled": True, "coc_parallel_num": 4}}), ctx)
    assert ctx.kernel_impls["all_gather_matmul"] == ctx.kernel_impls["matmul_reduce_scatter"] == "chunked"
    assert "coc" in report.order
    layer = torch.nn.Linear(2, 2)
    layer.coc_num_chunks = 2
    (hook,) = ctx.hooks["post_model_build"]
    hook([torch.nn.Sequential(layer)])
    assert layer.coc_num_chunks == 4
