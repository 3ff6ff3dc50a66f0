"""``--recompute-in-bubble`` on megatron's interleaved schedule: bit-identical to the run without it, less held.

One spawned group of 2 ranks, PP2 x VPP2 (4 layers, one per chunk), tiny fp32 GPT, 8
microbatches of 2 x 64 tokens, 3 Adam steps through the LLM trainer's ``run_schedule``. The
reference runs the same steps with a measuring wrapper that keeps every activation and counts
the saved bytes through the same hooks; the feature (its hook from ``adapt``, bound ``pp * vpp =
4``) and a bound of 2 must give the same losses and every gradient bit for bit, hold fewer saved
bytes at the peak on the first pipeline rank (5 chunk-forwards in flight there without the
feature), and regenerate every dropped chunk at a scheduler point (none inline in the
backward). A dropout of 0.1 checks that the recompute replays the RNG states.
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

STEPS, MICROBATCHES, MICRO_BATCH, SEQ = 3, 8, 2, 64


def _train(hook: Any) -> dict[str, Any]:
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

    model = TinyGPTConfig(seq_length=SEQ)
    sizes = ParallelSizes(pp=2, vpp=2)
    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(model, sizes, hidden_dropout=0.1, attention_dropout=0.1)
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
                losses.append(forward_backward(chunks, batches, groups=groups, schedule_hooks=(hook,)))
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
        stats = hook.__self__.passes
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
    """The feature from a recipe through the trainer: the same records, and its pass log line on rank 0."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("mindspeed.memory.ripipe")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        plain = _pretrain(data)
        featured = _pretrain(data, "features.settings.recompute_in_bubble.enabled=true")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return {"records_equal": plain == featured, "records": featured, "log": lines}


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
    out["recipe"] = _recipe(data)
    return out


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
def test_recompute_in_bubble_from_a_recipe_trains_like_the_run_without_it(outs: list[dict[str, Any]]) -> None:
    first, last = outs[0]["recipe"], outs[1]["recipe"]
    assert first["records_equal"] and last["records_equal"], first["records"]
    assert [r["step"] for r in first["records"]] == [1, 2]
    # Rank 0 (first pipeline stage) dropped chunk-forwards and regenerated them in the bubbles.
    assert any(line.startswith("recompute_in_bubble: 3 of 16") for line in first["log"]), first["log"]
    assert all(line.startswith("recompute_in_bubble: 0 of 16") for line in last["log"]), last["log"]
