"""Compute-communication overlap (the ``coc`` feature): the chunked pipelines equal the unfused pairs.

One spawned 2-rank gloo group checks, bit for bit in fp32 (``torch.equal``):

- the ops: ``all_gather_matmul``, ``matmul_reduce_scatter`` and ``matmul_all_reduce``'s ``chunked``
  kernels against their references (all-gather then GEMM; GEMM then reduce-scatter; GEMM then
  all-reduce), output and the gradients of the
  input and the weight, for 1, 2, 3 and more chunks than rows (uneven chunks included);
- the model: the tiny GPT (2 layers) at TP2 + sequence parallelism built with the CoC linears
  (every QKV / projection / fc1 / fc2 through the chunked ops, counted) against the same model
  built with megatron's linears: the first step's gradients of every parameter and the losses
  of 3 optimizer steps; once plain and once with biases in every linear and megatron's
  gradient-accumulation fusion (the weight gradients added into ``main_grad`` through
  ``matmul_add_fp32``, counted, either way).

The same group checks MC2's fused ``mm_all_reduce_add_rms_norm`` slot: its reference against the
unfused matmul, all-reduce, residual add and rms_norm (forward bit for bit, gradients to 1e-5).

The feature's one-line refusals (no TP, no sequence parallelism) are checked in-process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from mindspeed.testing.kernels import calls_of

LAYERS, STEPS = 2, 3


def _op_pairs(group: Any) -> list[str]:
    from mindspeed.ops import resolve_kernel

    problems = []
    rank = torch.distributed.get_rank()
    for op, rows in (("all_gather_matmul", 6), ("matmul_reduce_scatter", 12), ("matmul_all_reduce", 6)):
        ref, chunked = resolve_kernel(op, "reference"), resolve_kernel(op, "chunked")
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(rows, 2, 16, generator=gen)
        w = torch.randn(12, 16, generator=gen)
        g = torch.randn({"all_gather_matmul": 12}.get(op, 6), 2, 12, generator=gen)
        expected = _run(ref, x, w, g, group, 1)
        # matmul_all_reduce chunks the local rows only: 4 or 9 chunks of 6 rows leave GEMMs of
        # 2 rows (1 sequence row x batch 2), which the CPU GEMM computes on another path (up to
        # 1.9e-6 apart from the 12-row product); the gathered ops' chunks have >= 4 rows.
        for chunks in (1, 2, 3) if op == "matmul_all_reduce" else (1, 2, 4, 9):
            got = _run(chunked, x, w, g, group, chunks)
            for name, a, b in zip(("out", "dx", "dw"), expected, got):
                if not torch.equal(a, b):
                    problems.append(f"{op} chunks={chunks} {name}: max diff {(a - b).abs().max().item()}")
    return problems


def _add_rms_norm(group: Any) -> list[str]:
    """``mm_all_reduce_add_rms_norm`` (MC2's ``npu_mm_all_reduce_add_rms_norm`` slot): its reference
    equals the unfused sequence written out here, bit for bit forward; gradients against the same
    sequence with the other ranks' partial products as constants (the all-reduce's backward is the
    identity in megatron's row-parallel linear)."""
    from mindspeed.ops import resolve_kernel
    from mindspeed.ops.norms import rms_norm_reference

    op = resolve_kernel("mm_all_reduce_add_rms_norm", "reference")
    problems = []
    rank = torch.distributed.get_rank()
    for bias in (False, True):
        gen = torch.Generator().manual_seed(10 + rank)  # x and w are this rank's shards
        x, w = torch.randn(5, 2, 16, generator=gen), torch.randn(24, 16, generator=gen) / 4
        same = torch.Generator().manual_seed(20)  # residual, gamma, bias and cotangents: the same on every rank
        residual, gamma = torch.randn(5, 2, 24, generator=same), 1 + 0.1 * torch.randn(24, generator=same)
        b = 0.1 * torch.randn(24, generator=same) if bias else None
        g_y, g_n = torch.randn(5, 2, 24, generator=same), torch.randn(5, 2, 24, generator=same)
        leaves = [t.clone().requires_grad_() for t in (x, w, residual, gamma)]
        y, normed = op(*leaves, group, 1e-5, b)
        torch.autograd.backward((y, normed), (g_y, g_n))

        product = torch.matmul(x, w.t())
        reduced = product.clone()
        torch.distributed.all_reduce(reduced, group=group)
        want_y = residual + reduced if b is None else residual + reduced + b
        want_n = rms_norm_reference(want_y, gamma, 1e-5)
        for name, got, want in (("y", y, want_y), ("normed", normed, want_n)):
            if not torch.equal(got.detach(), want):
                problems.append(f"add_rms_norm bias={bias} {name}: max diff {(got - want).abs().max().item()}")
        plain = [t.clone().requires_grad_() for t in (x, w, residual, gamma)]
        local = torch.matmul(plain[0], plain[1].t())
        py = plain[2] + (local + (reduced - local).detach())
        py = py if b is None else py + b
        torch.autograd.backward((py, rms_norm_reference(py, plain[3], 1e-5)), (g_y, g_n))
        for name, got, want in zip(("dx", "dw", "dresidual", "dgamma"), leaves, plain):
            if not torch.allclose(got.grad, want.grad, atol=1e-5, rtol=1e-5):
                problems.append(f"add_rms_norm bias={bias} {name}: max diff {(got.grad - want.grad).abs().max()}")
    return problems


def _run(fn: Any, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, group: Any, chunks: int) -> tuple:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w, group, chunks)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def _train(coc: bool, fusion: bool, kernels: Any, sp: bool = True) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallelConfig
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

    kernels = {**kernels, "attention": "reference"}
    if coc:
        kernels.update(all_gather_matmul="chunked", matmul_reduce_scatter="chunked", matmul_all_reduce="chunked")
    model = TinyGPTConfig(num_layers=LAYERS, add_bias_linear=fusion)  # biases in the second pair of runs
    sizes = ParallelSizes(tp=2, sequence_parallel=sp)
    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(
            model,
            sizes,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            layer_spec=get_gpt_layer_spec(kernels, swiglu=False),
            gradient_accumulation_fusion=fusion,
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


def _compare(plain: dict[str, Any], coc: dict[str, Any]) -> dict[str, Any]:
    """Compared in the rank: tensors do not travel back from the ranks."""
    return {
        "losses": (plain["losses"], coc["losses"]),
        "grads": len(plain["grads"]),
        "grads_differ": {
            n: (g - coc["grads"][n]).abs().max().item()
            for n, g in plain["grads"].items()
            if not torch.equal(g, coc["grads"][n])
        },
        "calls": (plain["calls"], coc["calls"]),
    }


def _group(rank: int, world_size: int) -> dict[str, Any]:
    from mindspeed.features import FeaturesConfig
    from mindspeed.megatron import adapt, unadapt

    out: dict[str, Any] = {"ops": _op_pairs(torch.distributed.group.WORLD)}
    out["ops"] += _add_rms_norm(torch.distributed.group.WORLD)
    # Gradient-accumulation fusion's kernel is bound (the feature); each model asks for it or not.
    report = adapt(
        "cpu", features=FeaturesConfig(optimization_level=0, settings={"gradient_accumulation_fusion": True})
    )
    try:
        for fusion in (False, True):
            runs = [_train(coc, fusion, report.kernels) for coc in (False, True)]
            out["fused" if fusion else "plain"] = _compare(*runs)
        # Without sequence parallelism: the row-parallel linears' GEMM + all-reduce is matmul_all_reduce.
        out["no_sp"] = _compare(*[_train(coc, True, report.kernels, sp=False) for coc in (False, True)])
    finally:
        unadapt()
    return out


@pytest.mark.distributed
def test_coc_equals_the_unfused_pairs_bit_for_bit() -> None:
    for out in run_distributed(_group, 2, timeout=300):
        assert out["ops"] == []
        for fusion in ("plain", "fused", "no_sp"):
            run = out[fusion]
            plain_losses, coc_losses = run["losses"]
            assert coc_losses == plain_losses, fusion
            assert run["grads"] > 10 and run["grads_differ"] == {}, fusion
            plain_calls, coc_calls = run["calls"]
            linears = 2 * LAYERS * 2 * STEPS  # proj + fc2 (qkv + fc1) per layer, 2 microbatches x 3 steps
            if fusion == "no_sp":
                assert coc_calls[("matmul_all_reduce", "chunked")] == linears
                assert ("all_gather_matmul", "chunked") not in coc_calls
                assert ("matmul_all_reduce", "chunked") not in plain_calls
                assert calls_of(coc_calls, "matmul_add_fp32") == calls_of(plain_calls, "matmul_add_fp32") > 0
                continue
            # qkv + fc1 (proj + fc2) per layer, each forward of 2 microbatches x 3 steps
            assert ("matmul_all_reduce", "chunked") not in coc_calls
            assert coc_calls[("all_gather_matmul", "chunked")] == 2 * LAYERS * 2 * STEPS
            assert coc_calls[("matmul_reduce_scatter", "chunked")] == 2 * LAYERS * 2 * STEPS
            assert ("all_gather_matmul", "chunked") not in plain_calls
            # with the fusion, every linear's weight gradient went through the kernel either way
            accumulations = [calls_of(calls, "matmul_add_fp32") for calls in (plain_calls, coc_calls)]
            assert accumulations == ([(4 * LAYERS + 1) * 2 * STEPS] * 2 if fusion == "fused" else [0, 0]), fusion


def test_feature_refuses_without_tp_and_picks_the_ops_of_the_run() -> None:
    from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features

    ctx = BuildContext(parallel=ParallelSizes(tp=1), model=ModelFacts(extra={"sequence_parallel": True}))
    with pytest.raises(ValueError, match="feature 'coc'.*tp=1.*parallel.tp >= 2"):
        apply_features(FeaturesConfig(settings={"coc": True}), ctx)
    # Without sequence parallelism only the row-parallel linears' all-reduce is overlapped.
    ctx = BuildContext(parallel=ParallelSizes(tp=2), model=ModelFacts(extra={"sequence_parallel": False}))
    apply_features(FeaturesConfig(settings={"coc": True}), ctx)
    assert ctx.kernel_impls["matmul_all_reduce"] == "chunked"
    assert "all_gather_matmul" not in ctx.kernel_impls and "matmul_reduce_scatter" not in ctx.kernel_impls
    ctx = BuildContext(parallel=ParallelSizes(tp=2), model=ModelFacts(extra={"sequence_parallel": True}))
    report = apply_features(FeaturesConfig(settings={"coc": {"enabled": True, "coc_parallel_num": 4}}), ctx)
    assert ctx.kernel_impls["all_gather_matmul"] == ctx.kernel_impls["matmul_reduce_scatter"] == "chunked"
    assert "matmul_all_reduce" not in ctx.kernel_impls
    assert "coc" in report.order
    layer = torch.nn.Linear(2, 2)
    layer.coc_num_chunks = 2
    (hook,) = ctx.hooks["post_model_build"]
    hook([torch.nn.Sequential(layer)])
    assert layer.coc_num_chunks == 4
