"""Memory features on gloo ranks: the run with a feature equals the run without it and saves what a formula says.

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

- ``swap_attention`` (``self_attention``): losses, grad norms and gradients bit-identical; held
  bytes fall by at least two of the reference attention's ``[b, n/tp, s, s]`` matrices per layer
  and by no more than the hooks copied to the host.
- megatron's own recompute, as an LLM recipe's ``model`` section sets it: ``full`` with
  ``uniform`` and ``block`` methods (2 layers) and ``selective`` over ``core_attn`` and ``mlp``:
  losses, grad norms and gradients bit-identical, fewer bytes held (megatron 0.16's
  ``layernorm`` module needs Transformer Engine; ``recompute_norm`` does that job).

Optimizer state (DP2, 2 layers, 4 Adam steps of 2 microbatches; the device pool measured from
before the optimizer is built, host buffers excluded):

- ``reuse_fp32_param`` against megatron's bf16 optimizer with fp32 masters, with the distributed
  optimizer and with the plain one: losses, grad norms, bf16 weights and the fp32 masters
  (rebuilt from bf16 + remainder) bit-identical after every step, ties included (some occur);
  held and peak bytes fall by 2 bytes per master element of the rank.
- ``swap_optimizer`` (4 chunks) against the distributed optimizer: bit-identical in bf16 and
  fp32; held and peak bytes fall by 12 bytes per element of the rank's shard in bf16 (master +
  two moments) and 8 in fp32 (the master is the weight itself). Without the distributed
  optimizer the hook refuses, and enabling both features is refused as a conflict.

Held bytes are compared with the formula within ``SLACK`` (one small tensor the garbage
collector may free late), peaks within 10 %.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

LAYERS, SEQ, HIDDEN, FFN, MICRO_BATCH, TP = 4, 256, 64, 256, 2, 2
#: Held bytes may differ from the formula by one small tensor freed by the garbage collector.
SLACK = 4096
#: megatron's own recompute settings, as an LLM recipe's ``model`` section passes them.
MEGATRON_RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}
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


def _recompute_run(install: Any, bf16: bool, **megatron: Any) -> dict[str, Any]:
    """One measured forward/backward, then STEPS Adam steps, of the TP2 tiny GPT with ``install`` (or none)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.metrics.memory import StorageTracker
    from mindspeed.ops.mask_cache import clear_masks
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
        chunks = build_gpt(
            model,
            sizes,
            layer_spec=get_gpt_layer_spec(KERNELS),
            use_te_activation_func=True,
            bf16=bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            **megatron,
        )
        installed = install(chunks) if install is not None else None
        batch = local_batches(make_batches(model, 1, MICRO_BATCH))[0]
        gpt = unwrap(chunks[0])
        clear_masks()  # every run builds (and counts) its own shared attention mask, none inherits one
        tracker = StorageTracker()
        with tracker:
            loss = gpt(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
            gc.collect()  # a small tensor in a reference cycle would otherwise be freed at a random time
            held = tracker.live_bytes
            swapped = getattr(installed, "swapped_bytes", 0)  # by this forward
            loss.backward()
        grads = {name: local_grad(p).float().clone() for name, p in gpt.named_parameters()}
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, params_dtype=dtype, clip_grad=1.0), chunks
        )
        steps = [local_batches(make_batches(model, MICROBATCHES, MICRO_BATCH, seed=1))] * STEPS  # one batch, learnt
        history = train_steps(chunks, optimizer, steps)
        return {
            "loss": loss.item(),
            "held": held,
            "peak": tracker.peak_bytes,
            "grads": grads,
            "losses": history.losses,
            "grad_norms": history.grad_norms,
            "pairs": len(getattr(installed, "pairs", ())),
            "layers": getattr(installed, "layers", 0),
            "discarded": getattr(installed, "discarded", 0),
            "swapped": swapped,
        }
    finally:
        destroy_parallel()


def _compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    import torch

    scale = max(g.abs().max().item() for g in off["grads"].values())
    return {
        "loss_equal": on["loss"] == off["loss"],
        "losses_equal": on["losses"] == off["losses"],
        "grad_norms_equal": on["grad_norms"] == off["grad_norms"],
        "grads_equal": all(torch.equal(on["grads"][n], g) for n, g in off["grads"].items()),
        "grad_diff": max((on["grads"][n] - g).abs().max().item() for n, g in off["grads"].items()) / scale,
        "held_saving": off["held"] - on["held"],
        "peak_saving": off["peak"] - on["peak"],
        "pairs": on["pairs"],
        "layers": on["layers"],
        "discarded": on["discarded"],
        "losses": on["losses"],
        "swapped": on["swapped"],
    }


def _recompute(report: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bf16 in (False, True):
        off = _recompute_run(None, bf16)
        tag = "bf16" if bf16 else "fp32"
        out[f"act-{tag}"] = _compare(off, _recompute_run(_hooks(report, "activation"), bf16))
        out[f"norm-{tag}"] = _compare(off, _recompute_run(_hooks(report, "norm"), bf16))
        if not bf16:
            out["act-2-layers"] = _compare(off, _recompute_run(_hooks(report, "activation", 2), bf16))
            swap = next(h for h in report.hooks["post_model_build"] if type(h.__self__).__name__ == "SwapAttention")
            out["swap-attention"] = _compare(off, _recompute_run(swap, bf16))
            for name, fields in MEGATRON_RECOMPUTE.items():
                out[name] = _compare(off, _recompute_run(None, bf16, **fields))
    return out


def _memory_features(rank: int, world_size: int) -> dict[str, Any]:
    from mindspeed.features import FeaturesConfig
    from mindspeed.megatron import adapt, unadapt

    settings = {
        "recompute_activation_function": True,
        "recompute_norm": True,
        "swap_attention": {"enabled": True, "swap_modules": ["self_attention"]},
    }
    report = adapt("cpu", features=FeaturesConfig(optimization_level=0, settings=settings))
    try:
        out = {"enabled": report.features.enabled, "recompute": _recompute(report)}
    finally:
        unadapt()
    # reuse_fp32_param and swap_optimizer conflict: reuse comes from the adaptation, the swap hook
    # from its feature applied to a BuildContext of its own.
    report = adapt("cpu", features=FeaturesConfig(optimization_level=0, settings={"reuse_fp32_param": True}))
    try:
        out["enabled"] += report.features.enabled
        out["optimizer"] = _optimizer_state(report)
    finally:
        unadapt()
    return out


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
        assert abs(row["held_saving"] - LAYERS * per_layer) <= SLACK, (row["held_saving"], LAYERS * per_layer)
        assert abs(row["peak_saving"] - (LAYERS - 1) * per_layer) <= 0.1 * (LAYERS - 1) * per_layer, row["peak_saving"]
        half = out["recompute"]["act-2-layers"]
        assert half["pairs"] == 2 and abs(half["held_saving"] - 2 * per_layer) <= SLACK
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
        assert abs(row["held_saving"] - LAYERS * per_layer) <= SLACK, (row["held_saving"], LAYERS * per_layer)
        bf16 = out["recompute"]["norm-bf16"]
        assert bf16["grads_equal"] and bf16["losses_equal"] and bf16["grad_norms_equal"], bf16


# -- optimizer state: reuse_fp32_param, swap_optimizer (DP2) ------------------------------------

OPT_STEPS, OPT_LAYERS, SWAP_TIMES = 4, 2, 4


def _optimizer_hook(report: Any, cls_name: str) -> Any:
    for hook in report.hooks.get("post_optimizer_build", ()):
        if type(getattr(hook, "__self__", None)).__name__ == cls_name:
            return hook
    raise AssertionError(f"no {cls_name} hook in the report")


def _optimizer_run(hook: Any, bf16: bool, distributed: bool) -> dict[str, Any]:
    """OPT_STEPS Adam steps at DP2 with megatron's (distributed) optimizer, ``hook`` installed on it (or none).

    The device pool is measured from before the optimizer is built: ``held`` is what is live
    after the last step, ``peak`` the highest live total during steps 2.. (the state exists).
    """
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.memory.optimizer_step import master_pairs, sub_optimizers
    from mindspeed.metrics.memory import StorageTracker
    from mindspeed.testing.megatron import (
        ParallelSizes,
        TinyGPTConfig,
        build_gpt,
        destroy_parallel,
        init_parallel,
        local_batches,
        make_batches,
        train_steps,
        unwrap,
    )

    model = TinyGPTConfig(num_layers=OPT_LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, seq_length=64)
    sizes = ParallelSizes()
    dtype = torch.bfloat16 if bf16 else torch.float32
    init_parallel(sizes, model.seed)
    try:
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
        chunks = build_gpt(
            model,
            sizes,
            ddp,
            layer_spec=get_gpt_layer_spec(KERNELS),
            use_te_activation_func=True,
            bf16=bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
        )
        steps = [local_batches(make_batches(model, MICROBATCHES, MICRO_BATCH, seed=1))] * OPT_STEPS
        outer = StorageTracker()
        with outer:
            config = OptimizerConfig(
                optimizer="adam",
                lr=1e-2,
                bf16=bf16,
                params_dtype=dtype,
                clip_grad=1.0,
                use_distributed_optimizer=distributed,
            )
            optimizer = get_megatron_optimizer(config, chunks)
            state_elements = sum(pair.numel for sub in sub_optimizers(optimizer) for pair in master_pairs(sub))
            masters = sum(
                pair.numel for sub in sub_optimizers(optimizer) for pair in master_pairs(sub) if pair.model is not None
            )
            if hook is not None:
                optimizer = hook(optimizer) or optimizer
            first = train_steps(chunks, optimizer, steps[:1])
            base = outer.live_bytes
            inner = StorageTracker()
            with inner:
                rest = train_steps(chunks, optimizer, steps[1:])
            gc.collect()
            held = outer.live_bytes
        owner = getattr(hook, "__self__", None)
        if owner is not None and hasattr(owner, "masters"):
            final_masters = [m.clone() for m in owner.masters()]
        elif owner is not None:  # swapped: bring the masters back from the host buffers
            final_masters = [
                owner._host[id(pair.main)].clone()
                for sub in sub_optimizers(optimizer)
                for pair in master_pairs(sub)
                if pair.model is not None
            ]
        else:
            final_masters = [
                pair.main.detach().clone()
                for sub in sub_optimizers(optimizer)
                for pair in master_pairs(sub)
                if pair.model is not None
            ]
        params = {name: p.detach().float().clone() for name, p in unwrap(chunks[0]).named_parameters()}
        return {
            "losses": first.losses + rest.losses,
            "grad_norms": first.grad_norms + rest.grad_norms,
            "params": params,
            "masters": final_masters,
            "held": held,
            "peak": base + inner.peak_bytes,
            "state_elements": state_elements,
            "master_elements": masters,
            "ties": getattr(owner, "ties", 0),
            "chunked_steps": sum(s.steps for s in getattr(owner, "steps", [])),
        }
    finally:
        destroy_parallel()


def _compare_optimizer(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {
        "losses_equal": on["losses"] == off["losses"],
        "grad_norms_equal": on["grad_norms"] == off["grad_norms"],
        "params_equal": all(torch.equal(on["params"][n], p) for n, p in off["params"].items()),
        "masters_equal": len(on["masters"]) == len(off["masters"])
        and all(torch.equal(a, b) for a, b in zip(on["masters"], off["masters"])),
        "held_saving": off["held"] - on["held"],
        "peak_saving": off["peak"] - on["peak"],
        "state_elements": off["state_elements"],
        "master_elements": off["master_elements"],
        "ties": on["ties"],
        "chunked_steps": on["chunked_steps"],
        "losses": on["losses"],
    }


def _optimizer_state(report: Any) -> dict[str, Any]:
    from mindspeed.features import BuildContext, FeaturesConfig, apply_features

    out: dict[str, Any] = {}
    reuse = _optimizer_hook(report, "ReuseFp32Param")
    swap_settings = {"swap_optimizer": {"enabled": True, "swap_optimizer_times": SWAP_TIMES}}
    swap_context = BuildContext("cpu")
    apply_features(FeaturesConfig(optimization_level=0, settings=swap_settings), swap_context)
    swap = _optimizer_hook(swap_context, "SwapOptimizer")
    try:
        apply_features(FeaturesConfig(settings={"swap_optimizer": True, "reuse_fp32_param": True}), BuildContext("cpu"))
    except ValueError as error:
        out["conflict"] = str(error)
    for distributed in (True, False):
        off = _optimizer_run(None, bf16=True, distributed=distributed)
        out[f"reuse-{'distopt' if distributed else 'float16'}"] = _compare_optimizer(
            off, _optimizer_run(reuse if distributed else _fresh(reuse), bf16=True, distributed=distributed)
        )
        if distributed:
            out["swap-bf16"] = _compare_optimizer(off, _optimizer_run(swap, bf16=True, distributed=True))
    from mindspeed.memory.swap_optimizer import SwapOptimizer

    off = _optimizer_run(None, bf16=False, distributed=True)
    out["swap-fp32"] = _compare_optimizer(
        off, _optimizer_run(SwapOptimizer(times=SWAP_TIMES).install, bf16=False, distributed=True)
    )
    try:
        _optimizer_run(SwapOptimizer().install, bf16=True, distributed=False)
    except ValueError as error:
        out["swap-refused"] = str(error)
    return out


def _fresh(hook: Any) -> Any:
    """A new hook object of the same class and settings (a hook instance serves one optimizer)."""
    owner = hook.__self__
    return type(owner)(times=owner.times).install


@pytest.mark.distributed
def test_conflicting_optimizer_features_are_refused_with_the_reason(outs) -> None:
    out = outs[0]["optimizer"]
    assert "'reuse_fp32_param' and 'swap_optimizer' conflict" in out["conflict"]
    assert "needs megatron's distributed optimizer" in out["swap-refused"]
    assert "reuse_fp32_param" in outs[0]["enabled"]


@pytest.mark.distributed
def test_reuse_fp32_param_trains_as_the_bf16_optimizer_and_saves_2_bytes_per_parameter(outs) -> None:
    for out in outs:
        for name in ("reuse-distopt", "reuse-float16"):
            row = out["optimizer"][name]
            # Losses, grad norms, the bf16 weights and the fp32 masters rebuilt from bf16 + remainder.
            assert row["losses_equal"] and row["grad_norms_equal"] and row["params_equal"], (name, row)
            assert row["masters_equal"], name
            assert row["chunked_steps"] == OPT_STEPS
            formula = 2 * row["master_elements"]  # 4-byte master -> 2-byte remainder
            assert abs(row["held_saving"] - formula) <= SLACK, (name, row["held_saving"], formula)
            assert abs(row["peak_saving"] - formula) <= 0.1 * formula, (name, row["peak_saving"], formula)
    # DP2: the distributed optimizer's two shards make up the full copy the plain one keeps on each rank.
    assert (
        sum(out["optimizer"]["reuse-distopt"]["master_elements"] for out in outs)
        == outs[0]["optimizer"]["reuse-float16"]["master_elements"]
    )
    assert sum(out["optimizer"][n]["ties"] for out in outs for n in ("reuse-distopt", "reuse-float16")) > 0
    losses = outs[0]["optimizer"]["reuse-distopt"]["losses"]
    assert losses[-1] < losses[0]


@pytest.mark.distributed
def test_swap_optimizer_trains_identically_and_frees_the_state_shard(outs) -> None:
    for out in outs:
        for name, bytes_per_param in (("swap-bf16", 12), ("swap-fp32", 8)):
            row = out["optimizer"][name]
            assert row["losses_equal"] and row["grad_norms_equal"] and row["params_equal"], (name, row)
            assert row["masters_equal"] and row["chunked_steps"] == OPT_STEPS
            formula = bytes_per_param * row["state_elements"]  # master (bf16 only) + Adam's two moments
            assert abs(row["held_saving"] - formula) <= SLACK, (name, row["held_saving"], formula)
            assert abs(row["peak_saving"] - formula) <= 0.1 * formula, (name, row["peak_saving"], formula)


@pytest.mark.distributed
def test_swap_attention_trains_identically_and_moves_the_attention_activations_off_the_device(outs) -> None:
    heads_per_rank = 4 // TP
    score_matrix = MICRO_BATCH * heads_per_rank * SEQ * SEQ * 4  # one [b, n/tp, s, s] fp32 matrix
    for out in outs:
        row = out["recompute"]["swap-attention"]
        assert row["loss_equal"] and row["grads_equal"] and row["losses_equal"] and row["grad_norms_equal"], row
        # The reference attention saves three [b, n/tp, s, s] matrices (masked scores, exp,
        # probabilities) besides q, k, v, its input and output; the swap frees at least two per
        # layer, and never more than it copied (rope tables and the causal mask it copies are
        # shared, so they stay).
        assert LAYERS * 2 * score_matrix <= row["held_saving"] <= row["swapped"], (row["held_saving"], row["swapped"])
        assert row["peak_saving"] > 0


@pytest.mark.parametrize("name", list(MEGATRON_RECOMPUTE))
def test_megatron_recompute_settings_train_identically_and_hold_less(outs, name: str) -> None:
    # megatron's full (uniform / block) and selective recompute rerun the same forward: bit-identical.
    for rank in outs:
        got = rank["recompute"][name]
        assert got["losses_equal"] and got["grad_norms_equal"] and got["loss_equal"], (name, got["losses"])
        assert got["grads_equal"], (name, got["grad_diff"])
        assert got["held_saving"] > 0, (name, got["held_saving"])
