"""A megatron-core GPT trained with context parallelism 2 reproduces the single-rank run.

One spawned group of 2 gloo ranks trains the tiny GPT (registry layer spec, megatron's own
RotaryEmbedding, DDP and optimizer) for 5 Adam steps on the whole sequence, then again from
the same weights with CP=2 under every algorithm, the config fields coming from the
``context_parallel`` feature: ``ulysses_cp_algo``, ``megatron_cp_algo`` and
``hybrid_cp_algo`` in both degenerate forms on 2 ranks (Ulysses 2 x ring 1, Ulysses 1 x
ring 2), and ``kvallgather_cp_algo`` (megatron's ``cp_comm_type="all_gather"``). Per-step
losses and the final parameters must agree to fp32 round-off. The same group checks
``RegistryAttention`` under ``all_gather`` against the single-rank layer (output and q/k/v
gradients) where the GPT does not reach: a sliding window, packed sequences (megatron's THD
layout, each sequence split zig-zag) with a window, and ALiBi on packed sequences; and the same
three under adaptive CP (``cp_comm_type="p2p"`` with the feature's ``cp_adaptive``), which runs
window layers through the KV all-gather and ALiBi by its block rule. An ALiBi GPT (BLOOM's
position scheme) also trains 2 steps under the ring (``megatron_cp_algo``, every ring block
biased by its global positions) against its single-rank run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mindspeed.testing.distributed import run_distributed
from mindspeed.testing.megatron import (
    Comparison,
    TinyGPTConfig,
    broadcast_state,
    build_gpt,
    full_state,
    load_full_state,
    make_batches,
    merge_summaries,
)
from mindspeed.testing.megatron import ParallelSizes as Layout

# 4 heads and 2 kv heads: Ulysses over 2 ranks splits both. 32 tokens divide by 2 * CP.
MODEL = TinyGPTConfig(num_layers=2, seq_length=32)
STEPS, NUM_MICROBATCHES, MICRO_BATCH_SIZE, LR = 5, 2, 2, 1e-3
#: label -> the context_parallel feature's settings.
ALGOS: dict[str, dict[str, Any]] = {
    "ulysses": {"context_parallel_algo": "ulysses_cp_algo"},
    "ring": {"context_parallel_algo": "megatron_cp_algo"},
    "hybrid-u2r1": {"context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 2},
    "hybrid-u1r2": {"context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 1},
    "all_gather": {"context_parallel_algo": "kvallgather_cp_algo"},
}
#: The ALiBi GPT (registry spec with ALiBi, no rope) and what it trains under: label -> (settings, steps).
ALIBI_MODEL = dataclasses.replace(MODEL, position_embedding_type="alibi")
ALIBI_ALGOS: dict[str, tuple[dict[str, Any], int]] = {"alibi ring": ({"context_parallel_algo": "megatron_cp_algo"}, 2)}
#: RegistryAttention cases under all_gather: label -> (window_size, packed boundaries or None, ALiBi).
LAYER_CASES: dict[str, tuple[tuple[int, int] | None, tuple[int, ...] | None, bool]] = {
    "window": ((5, 0), None, False),
    "packed window": ((4, 0), (0, 8, 20, 32), False),
    "packed alibi": (None, (0, 12, 16, 32), True),
}


def _cp_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features

    facts = ModelFacts(
        extra={"num_attention_heads": MODEL.num_attention_heads, "num_query_groups": MODEL.num_query_groups}
    )
    ctx = BuildContext(parallel=ParallelSizes(cp=2), model=facts)
    apply_features(
        FeaturesConfig(optimization_level=0, settings={"context_parallel": {"enabled": True, **settings}}), ctx
    )
    return dict(ctx.config_overrides)


def _loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    # megatron's pretrain_gpt convention (three values): the schedule divides the local sum by
    # the LOCAL token count and by the microbatches, and does not multiply by the CP size (the
    # two-value form does, because it expects a loss already averaged over the CP group; our
    # plain local mean there would come out C times too large). DDP then averages gradients
    # over data x context parallel ranks, so with equal shards the gradient is that of the
    # mean over the CP ranks of their local means: the full-sequence mean.
    local_sum = per_token.float().sum()
    count = torch.tensor(per_token.numel(), dtype=torch.int)
    return local_sum, count, {"lm loss": (local_sum / per_token.numel()).detach()}


def _run(
    overrides: dict[str, Any], steps: list[list[dict]], initial: dict | None, model: TinyGPTConfig = MODEL
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train ``steps`` at CP = ``overrides['context_parallel_size']`` (1 when absent).

    Returns:
        The per-step losses of the whole batch, the initial and the final parameters (no
        tensor or pipeline parallelism, so local names and tensors are the single-rank ones).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.parallel.context_parallel import RING, split_for_context_parallel

    cp = overrides.get("context_parallel_size", 1)
    ps.initialize_model_parallel(context_parallel_size=cp)
    torch.manual_seed(MODEL.seed)
    model_parallel_cuda_manual_seed(MODEL.seed)
    alibi = model.position_embedding_type == "alibi"
    try:
        chunks = build_gpt(
            model,
            Layout(),
            layer_spec=get_gpt_layer_spec(impls={"attention": "reference"}, alibi=alibi),
            use_te_activation_func=True,
            bias_activation_fusion=False,
            **overrides,
        )
        if initial is None:
            broadcast_state(chunks)
        else:
            load_full_state(chunks, model, initial)
        start = full_state(chunks)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, clip_grad=1.0), chunks)
        rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()

        def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
            # Megatron's zig-zag split (RING layout) for every algorithm: it is what megatron's
            # RotaryEmbedding assumes; RegistryAttention reorders for Ulysses and hybrid.
            batch = {key: split_for_context_parallel(value, 1, rank, cp, RING) for key, value in next(data).items()}
            return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), _loss_func

        losses = []
        for batches in steps:
            optimizer.zero_grad()
            for chunk in chunks:
                chunk.zero_grad_buffer()
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=chunks,
                num_microbatches=len(batches),
                seq_length=model.seq_length // cp,
                micro_batch_size=MICRO_BATCH_SIZE,
            )
            # Each CP rank reports its shard's mean: average them (equal shards) for the sequence's.
            loss = torch.stack([item["lm loss"] for item in out]).mean().double()
            dist.all_reduce(loss, group=group)
            losses.append(loss.item() / cp)
            ok, _, _ = optimizer.step()
            assert ok, "the optimizer skipped a step"
        return losses, start, full_state(chunks)
    finally:
        ps.destroy_model_parallel()


def _layer_gaps(rank: int) -> dict[str, Any]:
    """RegistryAttention at CP2 vs the single-rank layer: rows of the output, q/k/v grads.

    Under ``all_gather``, and under adaptive CP (``cp_comm_type="p2p"``, ``cp_adaptive``), which
    runs these window / ALiBi layers through the KV all-gather.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed.parallel.context_parallel import RING, shard_ranges
    from mindspeed.parallel.context_parallel.layout import packed_shard_ranges

    seq, heads, groups = MODEL.seq_length, MODEL.num_attention_heads, MODEL.num_query_groups
    dim = MODEL.hidden_size // heads
    comparison = Comparison("all_gather layer", atol=2e-6, rtol=1e-5)
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        for index, (label, (window, bounds, alibi)) in enumerate(LAYER_CASES.items()):
            torch.manual_seed(100 + index)  # the same full tensors on both ranks; megatron's [s, b, n, d]
            q = torch.randn(seq, 1, heads, dim)
            k, v = (torch.randn(seq, 1, groups, dim) for _ in range(2))
            probe = torch.randn(seq, 1, heads * dim)
            if bounds is None:
                rows, params = torch.cat([torch.arange(a, b) for a, b in shard_ranges(seq, rank, 2, RING)]), None
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in packed_shard_ranges(bounds, rank, 2)])
                cu = torch.tensor(bounds, dtype=torch.int32)
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
            modes = [("", "all_gather", {}), ("adaptive ", "p2p", {"cp_adaptive": True})]
            if alibi:  # the ring takes ALiBi too (a window it does not)
                modes.append(("ring ", "p2p", {}))
            for mode, comm, extra in modes:
                _compare_layer(comparison, f"{mode}{label}", (q, k, v, probe), rows, params, window, alibi, comm, extra)
    finally:
        ps.destroy_model_parallel()
    return comparison.summary()


def _compare_layer(comparison, label, tensors, rows, params, window, alibi, comm, extra) -> None:
    """One RegistryAttention case at CP2 (``comm``, config ``extra``) against CP1: output rows and q/k/v grads."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed.megatron.config import ParallelSizes, transformer_config
    from mindspeed.megatron.modules import RegistryAttention

    q, k, v, probe = tensors
    seq = q.shape[0]
    outs, grads = [], []
    for cp, take in ((2, rows), (1, torch.arange(seq))):
        config = transformer_config(MODEL, ParallelSizes(cp=cp), window_size=window, **(extra if cp == 2 else {}))
        attn = RegistryAttention(
            config, 1, AttnMaskType.causal, "self", cp_comm_type=comm, impl="reference", alibi=alibi
        )
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        inputs = [t[take] if params is None else t[take].squeeze(1) for t in leaves]
        out = attn(*inputs, None, packed_seq_params=params).reshape(len(take), 1, -1)
        (out * probe[take]).sum().backward()
        grad = [t.grad for t in leaves]
        if cp == 2:  # each rank has the gradient of its rows' loss: sum them
            for g in grad:
                dist.all_reduce(g, group=ps.get_context_parallel_group())
        outs.append(out.detach()[:, 0] if cp == 2 else out.detach()[rows, 0])
        grads.append(grad)
    comparison.add(f"{label} out", outs[0], outs[1])
    for name, got, want in zip("qkv", *grads):
        comparison.add(f"{label} d{name}", got, want)


def _check(rank: int, world_size: int) -> list[dict[str, Any]]:
    from mindspeed.megatron import adapt, unadapt

    adapt()
    try:
        steps = [make_batches(MODEL, NUM_MICROBATCHES, MICRO_BATCH_SIZE, seed=step) for step in range(STEPS)]
        ref_losses, initial, final = _run({}, steps, None)
        summaries = []
        runs = [(label, settings, STEPS, MODEL) for label, settings in ALGOS.items()]
        runs += [(label, settings, count, ALIBI_MODEL) for label, (settings, count) in ALIBI_ALGOS.items()]
        references = {MODEL: (ref_losses, initial, final)}
        for label, settings, count, model in runs:
            if model not in references:
                references[model] = _run({}, steps[:count], None, model)
            ref_losses, initial, final = references[model]
            losses, _, params = _run(_cp_overrides(settings), steps[:count], initial, model)
            comparison = Comparison(label, atol=2e-5, rtol=1e-4)
            for step, (loss, expected) in enumerate(zip(losses, ref_losses)):
                comparison.add(f"loss step {step}", loss, expected, atol=1e-5, rtol=1e-6)
            assert params.keys() == final.keys()
            for name, value in params.items():
                comparison.add(f"param {name}", value, final[name])
            comparison.extra["moved"] = max((final[n] - initial[n]).abs().max().item() for n in final)
            summaries.append(comparison.summary())
        summaries.append(_layer_gaps(rank))
    finally:
        unadapt()
    return summaries


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return merge_summaries(run_distributed(_check, 2, timeout=600))


@pytest.mark.distributed
@pytest.mark.parametrize("label", [*ALGOS, *ALIBI_ALGOS])
def test_cp2_training_matches_single_rank(results: dict[str, dict[str, Any]], label: str) -> None:
    result = results[label]
    assert not result["failures"], f"{label} differs from the single-rank run:\n" + "\n".join(result["failures"])
    steps = ALIBI_ALGOS[label][1] if label in ALIBI_ALGOS else STEPS
    assert len([name for name in result["names"] if name.startswith("loss")]) == steps
    # Training moved the weights well beyond the tolerance, so equal final params mean something.
    assert result["moved"] > 1e-3


@pytest.mark.distributed
def test_all_gather_attention_layer_matches_single_rank(results: dict[str, dict[str, Any]]) -> None:
    result = results["all_gather layer"]
    assert not result["failures"], "all_gather RegistryAttention differs:\n" + "\n".join(result["failures"])
    # all_gather, adaptive (which picks it or the ring), and the ring for the ALiBi cases
    assert len(result["names"]) == 2 * 4 * len(LAYER_CASES) + 4 * sum(alibi for _, _, alibi in LAYER_CASES.values())
