"""Memory features on gloo ranks: the run with the feature equals the run without it, and saves what a formula says.

One spawned group of 2 ranks checks every memory feature (house rule: many checks per group).
The features are applied by ``adapt(features=...)``; their hooks (the ones the trainers call)
are taken from the report and called on freshly built tiny GPTs.

Recompute (TP2, the registry spec: reference RMSNorm, SwiGLU and attention kernels; 4 layers,
micro batch 2 x 256 tokens, so ``T = 512`` tokens per rank, hidden 64, MLP width 256 or 128 per
TP rank):

- ``recompute_activation_function``: 3 Adam steps of 2 microbatches give the same losses and
  grad norms bit for bit, and one forward/backward the same gradients bit for bit. The bytes
  held from the forward into the backward fall by ``L x T x ffn/tp x 4`` (the activation
  outputs: the registry SwiGLU keeps only its input, which the checkpoint keeps too), exactly;
  the peak of forward + backward by ``(L - 1) x`` that within 10 % (the last layer's output is
  recomputed at the peak, the start of the backward). ``num_layers=2`` installs two layers'
  worth and saves half.
- ``recompute_norm``: the same losses bit for bit; fp32 gradients within 1e-6 of their
  largest entry (the reference RMSNorm uses its fp32 input three times, so the input gradient
  is the same three terms added in another order: ulp-level), and bit-identical in bf16, where
  the norm's upcast separates the uses. Held bytes fall by ``L x 2 x (T x h x 4 + T x 4)`` (both
  norms' outputs and fp32 rstd), exactly.
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

LAYERS, SEQ, HIDDEN, FFN, MICRO_BATCH, TP = 4, 256, 64, 256, 2, 2
STEPS, MICROBATCHES = 3, 2
KERNELS = {op: "reference" for op in ("rms_norm", "layer_norm", "attention", "swiglu")}


def _hooks(report: Any, kind: str, num_layers: int | None = None) -> Any:
    """The feature's post_model_build hook of ``kind`` (a LayerRecompute.install), with ``num_layers``."""
    from mindspeed.memory.recompute import LayerRecompute

    for hook in report.hooks.get("post_model_build", ()):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, LayerRecompute) and owner.kind == kind:
            return LayerRecompute(kind, num_layers).install if num_layers is not None else hook
    raise AssertionError(f"no {kind} hook in the report")


def _recompute_run(install: Any, bf16: bool) -> dict[str, Any]:
    """One measured forward/backward, then STEPS Adam steps, of the TP2 tiny GPT with ``install`` (or none)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.metrics.memory import StorageTracker
    from mindspeed.testing.megatron import (
        ParallelSizes,
        TinyGPTConfig,
        build_gpt,
        destroy_parallel,
        init_parallel,
        local_batches,
        local_grad,
        make_batches,
        train_steps,
        unwrap,
    )

    model = TinyGPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, seq_length=SEQ)
    sizes = ParallelSizes(tp=TP)
    dtype = torch.bfloat16 if bf16 else torch.float32
    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(model, sizes, layer_spec=get_gpt_layer_spec(KERNELS), use_te_activation_func=True,
                           bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)
        installed = install(chunks) if install is not None else None
        batch = local_batches(make_batches(model, 1, MICRO_BATCH))[0]
        gpt = unwrap(chunks[0])
        tracker = StorageTracker()
        with tracker:
            loss = gpt(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
            held = tracker.live_bytes
            loss.backward()
        grads = {name: local_grad(p).float().clone() for name, p in gpt.named_parameters()}
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, params_dtype=dtype,
                                                           clip_grad=1.0), chunks)
        steps = [local_batches(make_batches(model, MICROBATCHES, MICRO_BATCH, seed=1))] * STEPS  # one batch, learnt
        history = train_steps(chunks, optimizer, steps)
        return {"loss": loss.item(), "held": held, "peak": tracker.peak_bytes, "grads": grads,
                "losses": history.losses, "grad_norms": history.grad_norms,
                "pairs": len(installed.pairs) if installed else 0, "layers": installed.layers if installed else 0,
                "discarded": installed.discarded if installed else 0}
    finally:
        destroy_parallel()


def _compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    import torch

    scale = max(g.abs().max().item() for g in off["grads"].values())
    return {"loss_equal": on["loss"] == off["loss"], "losses_equal": on["losses"] == off["losses"],
            "grad_norms_equal": on["grad_norms"] == off["grad_norms"],
            "grads_equal": all(torch.equal(on["grads"][n], g) for n, g in off["grads"].items()),
            "grad_diff": max((on["grads"][n] - g).abs().max().item() for n, g in off["grads"].items()) / scale,
            "held_saving": off["held"] - on["held"], "peak_saving": off["peak"] - on["peak"],
            "pairs": on["pairs"], "layers": on["layers"], "discarded": on["discarded"], "losses": on["losses"]}


def _recompute(report: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bf16 in (False, True):
        off = _recompute_run(None, bf16)
        tag = "bf16" if bf16 else "fp32"
        out[f"act-{tag}"] = _compare(off, _recompute_run(_hooks(report, "activation"), bf16))
        out[f"norm-{tag}"] = _compare(off, _recompute_run(_hooks(report, "norm"), bf16))
        if not bf16:
            out["act-2-layers"] = _compare(off, _recompute_run(_hooks(report, "activation", 2), bf16))
    return out


def _memory_features(rank: int, world_size: int) -> dict[str, Any]:
    from mindspeed.features import FeaturesConfig
    from mindspeed.megatron import adapt, unadapt

    settings = {"recompute_activation_function": True, "recompute_norm": True}
    report = adapt("cpu", features=FeaturesConfig(optimization_level=0, settings=settings))
    try:
        return {"enabled": report.features.enabled, "recompute": _recompute(report)}
    finally:
        unadapt()


@pytest.fixture(scope="module")
def outs() -> list[dict[str, Any]]:
    return run_distributed(_memory_features, 2, timeout=600)


@pytest.mark.distributed
def test_recompute_features_are_applied(outs) -> None:
    assert set(outs[0]["enabled"]) >= {"recompute_activation_function", "recompute_norm"}


@pytest.mark.distributed
def test_activation_recompute_is_bit_identical_and_saves_the_activation_outputs(outs) -> None:
    tokens = MICRO_BATCH * SEQ
    per_layer = tokens * FFN // TP * 4
    for out in outs:
        row = out["recompute"]["act-fp32"]
        assert row["loss_equal"] and row["grads_equal"] and row["losses_equal"] and row["grad_norms_equal"], row
        assert row["pairs"] == LAYERS and row["discarded"] >= LAYERS
        assert row["held_saving"] == LAYERS * per_layer, (row["held_saving"], LAYERS * per_layer)
        assert abs(row["peak_saving"] - (LAYERS - 1) * per_layer) <= 0.1 * (LAYERS - 1) * per_layer, row["peak_saving"]
        half = out["recompute"]["act-2-layers"]
        assert half["pairs"] == 2 and half["held_saving"] == 2 * per_layer
        assert half["grads_equal"] and half["losses_equal"]
        bf16 = out["recompute"]["act-bf16"]
        assert bf16["grads_equal"] and bf16["losses_equal"] and bf16["grad_norms_equal"]
    assert outs[0]["recompute"]["act-fp32"]["losses"][-1] < outs[0]["recompute"]["act-fp32"]["losses"][0]


@pytest.mark.distributed
def test_norm_recompute_equals_the_run_without_it_and_saves_both_norm_outputs(outs) -> None:
    tokens = MICRO_BATCH * SEQ
    per_layer = 2 * (tokens * HIDDEN * 4 + tokens * 4)
    for out in outs:
        row = out["recompute"]["norm-fp32"]
        assert row["loss_equal"] and row["losses_equal"], row["losses"]
        assert row["grad_diff"] < 1e-6, row["grad_diff"]
        assert row["pairs"] == 2 * LAYERS
        assert row["held_saving"] == LAYERS * per_layer, (row["held_saving"], LAYERS * per_layer)
        bf16 = out["recompute"]["norm-bf16"]
        assert bf16["grads_equal"] and bf16["losses_equal"] and bf16["grad_norms_equal"], bf16
