"""gradient_accumulation_fusion: megatron's linear layers accumulate weight gradients through the
registry's ``matmul_add_fp32`` into the fp32 ``main_grad``, with the numbers of the run without it.

One spawned 2-rank group (TP2 with sequence parallelism, so the all-gathered ``[s, b, h]``
input of the weight-gradient GEMM is exercised) adapts megatron-core with only the fusion
feature on and trains the tiny GPT 3 steps of 2 microbatches twice per precision: with
``TransformerConfig(gradient_accumulation_fusion=True)`` and without. Checked, in fp32 and in
bf16 (fp32 ``main_grad`` through ``grad_reduce_in_fp32``): the first step's gradients of every
parameter and the three losses agree with the unfused run; the kernel ran once per linear
layer per microbatch (4 linears a layer and the output layer) and never without the flag; and
``unadapt()`` puts megatron's module back as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

STEPS, MICROBATCHES, MICRO_BATCH_SIZE, LAYERS = 3, 2, 2, 2


def _train(precision: str, fused: bool, kernels: Any) -> dict[str, Any]:
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

    model = TinyGPTConfig(num_layers=LAYERS)
    sizes = ParallelSizes(tp=2, sequence_parallel=True)
    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(
            model,
            sizes,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            layer_spec=get_gpt_layer_spec(kernels, swiglu=False),
            bf16=bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            gradient_accumulation_fusion=fused,
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=3e-3, bf16=bf16, params_dtype=dtype, clip_grad=1.0), chunks
        )
        steps = [local_batches(make_batches(model, MICROBATCHES, MICRO_BATCH_SIZE))] * STEPS  # one batch, learnt
        with count_kernel_calls() as calls:
            optimizer.zero_grad()
            losses = [global_loss(run_forward_backward(chunks, steps[0]))]
            grads = {
                name: local_grad(p).float().clone() for chunk in chunks for name, p in unwrap(chunk).named_parameters()
            }
            optimizer.step()
            losses += [train_step(chunks, optimizer, batches)[0] for batches in steps[1:]]
        return {"losses": losses, "grads": grads, "calls": dict(calls)}
    finally:
        destroy_parallel()


def _fusion(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core.tensor_parallel import layers

    from mindspeed.features import FeaturesConfig
    from mindspeed.megatron import adapt, unadapt

    before = (hasattr(layers, "fused_weight_gradient_mlp_cuda"), layers._grad_accum_fusion_available)
    report = adapt(
        "cpu", features=FeaturesConfig(optimization_level=0, settings={"gradient_accumulation_fusion": True})
    )
    try:
        out: dict[str, Any] = {
            "kernels": dict(report.kernels),
            "overrides": report.config_overrides,
            "patches": [p.name for p in report.patches if "grad-accum" in p.name],
        }
        for precision in ("fp32", "bf16"):
            plain, fused = (_train(precision, flag, report.kernels) for flag in (False, True))
            scale = max(g.abs().max().item() for g in plain["grads"].values())
            out[precision] = {
                "grad_diff": max((fused["grads"][n] - g).abs().max().item() for n, g in plain["grads"].items()) / scale,
                "loss_diff": max(abs(a - b) for a, b in zip(plain["losses"], fused["losses"])),
                "losses": fused["losses"],
                "calls": fused["calls"],
                "plain_calls": plain["calls"],
            }
    finally:
        unadapt()
    out["restored"] = (hasattr(layers, "fused_weight_gradient_mlp_cuda"), layers._grad_accum_fusion_available) == before
    return out


@pytest.mark.distributed
def test_fusion_accumulates_through_the_kernel_with_unfused_numbers() -> None:
    outs = run_distributed(_fusion, 2, timeout=300)
    out = outs[0]
    impl = out["kernels"]["matmul_add_fp32"]
    assert out["overrides"] == {"gradient_accumulation_fusion": True}
    assert out["patches"] == ["grad-accum-fusion-kernel", "grad-accum-fusion-available"]
    linears = 4 * LAYERS + 1  # qkv, proj, fc1, fc2 per layer, and the output layer
    # fp32: the same GEMM into main_grad (measured: identical). bf16: unfused, megatron rounds each
    # weight gradient to bf16 before adding it to main_grad, fused accumulates in fp32 (measured:
    # gradients 2.2e-3 of their largest entry apart, losses 3e-4).
    for precision, grad_tol, loss_tol in (("fp32", 1e-6, 1e-6), ("bf16", 1e-2, 1e-3)):
        row = out[precision]
        # Every linear layer's weight gradient went through the kernel, in every microbatch.
        assert row["calls"].get(("matmul_add_fp32", impl)) == STEPS * MICROBATCHES * linears, row["calls"]
        assert not any(op == "matmul_add_fp32" for op, _ in row["plain_calls"])
        assert row["grad_diff"] < grad_tol, (precision, row["grad_diff"])
        assert row["loss_diff"] < loss_tol, (precision, row["loss_diff"])
        assert row["losses"][-1] < row["losses"][0]  # it trains
    assert outs[0]["fp32"]["losses"] == outs[1]["fp32"]["losses"]
    assert out["restored"]
