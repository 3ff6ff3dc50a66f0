"""Recompute-independent pipelining on megatron's interleaved schedule: each feature equals its reference bit for bit.

One spawned group of 2 ranks, PP2 x VPP2, tiny fp32 GPT with dropout 0.1 (the recompute must
replay the RNG states), 8 microbatches of 2 x 64 tokens, 3 Adam steps through the LLM trainer's
``run_schedule``:

- ``recompute_in_bubble`` (4 layers, one per chunk): the reference runs the same steps with a
  measuring wrapper that keeps every activation and counts the saved bytes through the same
  hooks; the feature (its hook from ``adapt``, bound ``pp * vpp = 4``) and a bound of 2 give the
  same losses and every gradient bit for bit, hold fewer saved bytes at the peak on the first
  pipeline rank (5 chunk-forwards in flight there without the feature) and regenerate every
  dropped chunk-forward before its backward (none inline in the backward).
- ``recompute_in_advance`` (8 layers, 2 per chunk): against megatron's block recompute of 2
  layers per chunk, bit for bit; the model's last layer is not recomputed.
- From recipes (``pretrain``, 2 steps): each feature's records equal its reference's (no
  recompute; megatron's block recompute), and each logs what its first pass did.
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

STEPS, MICROBATCHES, MICRO_BATCH, SEQ = 3, 8, 2, 64
#: recompute_in_advance: 8 layers (2 per chunk), megatron's block recompute of 2 per chunk.
ADVANCE_LAYERS = 2


def _train(hook: Any, install: Any = None, num_layers: int = 4, **megatron: Any) -> dict[str, Any]:
    """STEPS Adam steps of the PP2 x VPP2 tiny GPT with the schedule ``hook`` (``None``: none)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.metrics.memory import StorageTracker
    from mindspeed.testing.megatron import (
        ParallelSizes,
        TinyGPTConfig,
        build_gpt,
        destroy_parallel,
        init_parallel,
        make_batches,
        unwrap,
    )
    from mindspeed_llm.training.model import default_groups
    from mindspeed_llm.training.steps import forward_backward

    model = TinyGPTConfig(seq_length=SEQ, num_layers=num_layers)
    sizes = ParallelSizes(pp=2, vpp=2)
    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(model, sizes, hidden_dropout=0.1, attention_dropout=0.1, **megatron)
        if install is not None:
            install(chunks)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), chunks)
        groups = default_groups()
        losses, grads, peaks = [], [], []
        for step in range(STEPS):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            batches = make_batches(model, MICROBATCHES, MICRO_BATCH, seed=step)
            for batch in batches:
                batch["loss_mask"] = torch.ones_like(batch["tokens"], dtype=torch.float)
            tracker = StorageTracker()
            with tracker:
                hooks = (hook,) if hook is not None else ()
                losses.append(forward_backward(chunks, batches, groups=groups, schedule_hooks=hooks))
            peaks.append(tracker.peak_bytes)
            grads.append(
                {
                    f"{i}.{name}": p.main_grad.detach().clone()
                    for i, chunk in enumerate(chunks)
                    for name, p in unwrap(chunk).named_parameters()
                }
            )
            ok, _, _ = optimizer.step()
            assert ok
        stats = hook.__self__.passes if hook is not None else []
        return {
            "losses": losses,
            "grads": grads,
            "saved_peak": [s.saved.peak for s in stats],
            "saved_end": [s.saved.now for s in stats],
            "tracker_peak": peaks,
            "dropped": [s.dropped for s in stats],
            "scheduled": [s.scheduled for s in stats],
            "inline": [s.inline for s in stats],
            "at_backward": [s.at_backward for s in stats],
        }
    finally:
        destroy_parallel()


def _pretrain(data: str, *extra: str) -> list[dict[str, Any]]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    overrides = [
        f"data.prefixes=[{data}]",
        "data.seq_length=32",
        "data.split=100,0,0",
        "model.vocab_size=128",
        "model.num_layers=4",
        "model.num_query_groups=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
        "train.lr=3e-3",
        "logging.progress=false",
        *extra,
    ]
    result = pretrain(load_pretrain_config(None, overrides))
    return [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in result.records if r["kind"] == "train"]


def _recipe(data: str) -> dict[str, Any]:
    """The features from a recipe through the trainer: the same records as their references, in-bubble's log line."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logs = [logging.getLogger(f"mindspeed.memory.{name}") for name in ("ripipe", "ripipe_advance")]
    levels = [log.level for log in logs]
    for log in logs:
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    block = ("model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=1")
    try:
        plain = _pretrain(data)
        featured = _pretrain(data, "features.settings.recompute_in_bubble.enabled=true")
        megatron_block = _pretrain(data, *block)
        advance = _pretrain(data, *block, "features.settings.recompute_in_advance.enabled=true")
    finally:
        for log, level in zip(logs, levels):
            log.removeHandler(handler)
            log.setLevel(level)
    return {
        "records_equal": plain == featured,
        "records": featured,
        "log": lines,
        "advance_equal": advance == megatron_block,
        "advance_records": advance,
    }


def _ripipe(rank: int, world_size: int, data: str) -> dict[str, Any]:
    import torch

    from mindspeed.features import FeaturesConfig, ParallelSizes
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.memory.ripipe import RecomputeInBubble

    features = FeaturesConfig(optimization_level=0, settings={"recompute_in_bubble": True})
    report = adapt("cpu", features=features, parallel=ParallelSizes(pp=2, vpp=2))
    try:
        (hook,) = report.hooks["pipeline_schedule"]
        runs = {
            "reference": _train(RecomputeInBubble(measure_only=True).for_pass),
            "feature": _train(hook),
            "kept-2": _train(RecomputeInBubble(kept_chunks=2).for_pass),
        }
        ref = runs["reference"]
        out: dict[str, Any] = {"enabled": report.features.enabled, "rank": rank}
        for name, run in runs.items():
            out[name] = {
                "losses_equal": run["losses"] == ref["losses"],
                "grads_equal": all(
                    sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
                    for a, b in zip(run["grads"], ref["grads"])
                ),
                **{k: v for k, v in run.items() if k != "grads"},
            }
    finally:
        unadapt()
    out["advance"] = _advance()
    out["recipe"] = _recipe(data)
    return out


def _compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {
        "losses_equal": run["losses"] == ref["losses"],
        "grads_equal": all(
            sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(run["grads"], ref["grads"])
        ),
        **{k: v for k, v in run.items() if k != "grads"},
    }


def _advance() -> dict[str, Any]:
    """recompute_in_advance (its hooks and config override from ``adapt``) against megatron's block recompute."""
    from mindspeed.features import FeaturesConfig, ModelFacts, ParallelSizes
    from mindspeed.megatron import adapt, unadapt

    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=ADVANCE_LAYERS)
    features = FeaturesConfig(optimization_level=0, settings={"recompute_in_advance": True})
    facts = ModelFacts(num_moe_experts=0, extra=block)
    report = adapt("cpu", features=features, parallel=ParallelSizes(pp=2, vpp=2), model=facts)
    try:
        (install,), (hook,) = report.hooks["post_model_build"], report.hooks["pipeline_schedule"]
        overrides = report.config_overrides
        reference = _train(None, num_layers=8, **block)
        run = _train(hook, install, num_layers=8, **{**block, **overrides})
        return {
            "enabled": report.features.enabled,
            "overrides": dict(overrides),
            "hooked_layers": len(install.__self__.layers),
            **_compare(run, reference),
        }
    finally:
        unadapt()


@pytest.fixture(scope="module")
def outs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.llm.training.datasets import write_indexed_dataset

    data = write_indexed_dataset(tmp_path_factory.mktemp("ripipe") / "d", 200, seed=3)
    return run_distributed(_ripipe, 2, data, timeout=600)


@pytest.mark.distributed
def test_recompute_in_bubble_is_bit_identical_and_holds_less(outs: list[dict[str, Any]]) -> None:
    for out in outs:
        assert "recompute_in_bubble" in out["enabled"]
        for name in ("feature", "kept-2"):
            run = out[name]
            assert run["losses_equal"] and run["grads_equal"], (
                out["rank"],
                name,
                run["losses"],
                out["reference"]["losses"],
            )
            assert run["inline"] == [0] * STEPS, (out["rank"], name, run)
            regenerated = [a + b for a, b in zip(run["scheduled"], run["at_backward"])]
            assert regenerated == run["dropped"], (out["rank"], name, run)
            assert run["saved_end"] == [0] * STEPS, (out["rank"], name, run)
    first, last = outs[0], outs[1]
    ref, feature, kept2 = first["reference"], first["feature"], first["kept-2"]
    assert all(d > 0 for d in feature["dropped"]) and all(d > 0 for d in kept2["dropped"])
    assert all(f < r for f, r in zip(feature["saved_peak"], ref["saved_peak"])), (feature, ref)
    assert all(k < f for k, f in zip(kept2["saved_peak"], feature["saved_peak"])), (kept2, feature)
    # The last pipeline rank never holds more than pp * vpp chunk-forwards: nothing to drop.
    assert last["feature"]["dropped"] == [0] * STEPS
    assert feature["at_backward"] == [0] * STEPS and all(n > 0 for n in kept2["scheduled"]), (feature, kept2)
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.distributed
def test_recompute_in_advance_is_bit_identical_to_megatron_block_recompute(outs: list[dict[str, Any]]) -> None:
    for out in outs:
        run = out["advance"]
        assert run["enabled"] == ["recompute_in_advance"] and run["overrides"] == {"recompute_granularity": None}
        assert run["losses_equal"] and run["grads_equal"], (out["rank"], run["losses"])
        assert run["inline"] == [0] * STEPS and run["saved_end"] == [0] * STEPS, run
        # Every chunk-forward (16 per pass) recomputes layers; all regenerated before their backward.
        assert run["dropped"] == [16] * STEPS, run
        assert [a + b for a, b in zip(run["scheduled"], run["at_backward"])] == run["dropped"], run
    first, last = outs[0]["advance"], outs[1]["advance"]
    # 2 of each chunk's 2 layers, less the model's last layer on the last stage.
    assert first["hooked_layers"] == 4 and last["hooked_layers"] == 3
    assert all(n > 0 for n in first["scheduled"]), first


@pytest.mark.distributed
def test_both_from_a_recipe_train_like_their_references(outs: list[dict[str, Any]]) -> None:
    first, last = outs[0]["recipe"], outs[1]["recipe"]
    assert first["records_equal"] and last["records_equal"], first["records"]
    assert [r["step"] for r in first["records"]] == [1, 2]
    # recompute_in_advance from a recipe (block recompute of 1 layer per chunk) = megatron's block recompute.
    assert first["advance_equal"] and last["advance_equal"], first["advance_records"]
    # Rank 0 (first pipeline stage) dropped chunk-forwards and regenerated them in the bubbles.
    assert "recompute_in_bubble: 3 of 16" in first["log"][0], first["log"]
    assert "recompute_in_bubble: 0 of 16" in last["log"][0], last["log"]
    # recompute_in_advance ran (megatron's recompute off): both layers of rank 0, rank 1's first
    # chunk's layer (its last chunk holds only the model's last layer, not recomputed).
    assert "recompute_in_advance: 16 of 16 chunk-forwards recompute layers (2 hooked" in first["log"][1], first["log"]
    assert "recompute_in_advance: 8 of 16 chunk-forwards recompute layers (1 hooked" in last["log"][1], last["log"]
    assert len(first["log"]) == len(last["log"]) == 2
