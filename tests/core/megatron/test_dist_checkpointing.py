"""megatron's dist_checkpointing saves at one layout and resumes exactly at others (gloo ranks).

Two ranks train the tiny GPT for two steps at TP1 / DP2 with the distributed optimizer, save
model and optimizer (``fully_reshardable``), then take one more step: that continuation is
the reference. The checkpoint is then loaded at TP2 and at PP2 (each with its own distributed
optimizer): the loaded parameters, the loss of the next batch before and after the step, the
gradient norm and the parameters after the step must all match the continuation. The step
after the load depends on Adam's moments and step count, so it checks that the optimizer
state, not only the weights, was resharded correctly.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
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
    full_state,
    global_loss,
    init_parallel,
    local_batches,
    make_batches,
    merge_summaries,
    run_forward_backward,
    train_step,
    unwrap,
)

MODEL = TinyGPTConfig(num_layers=2)
NUM_MICROBATCHES, MICRO_BATCH_SIZE = 2, 4
#: Resharding the optimizer across TP / PP / DP needs this type (the default one is deprecated
#: and fails in megatron-core 0.16 with "ShardedTensor.flattened_range is not supported").
METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
LOAD_LAYOUTS = {"tp2": ParallelSizes(tp=2), "pp2": ParallelSizes(pp=2)}


def _setup(sizes: ParallelSizes) -> tuple[list[Any], Any]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_parallel(sizes, MODEL.seed)
    chunks = build_gpt(MODEL, sizes, DistributedDataParallelConfig(use_distributed_optimizer=True))
    config = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    return chunks, get_megatron_optimizer(config, chunks)


def _sharded_state(chunks: list[Any], optimizer: Any, is_loading: bool) -> dict[str, Any]:
    (chunk,) = chunks
    model = unwrap(chunk).sharded_state_dict()
    return {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=METADATA)}


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    # Even a synchronous torch_dist save forks one writer process per file bucket (and starts
    # a multiprocessing Manager for their results); the harness's ranks are daemonic, and
    # daemonic processes may not have children. Megatron joins its writers before returning.
    process = multiprocessing.current_process()
    daemon, process.daemon = process.daemon, False
    try:
        yield
    finally:
        process.daemon = daemon


def _next_batch(chunks: list[Any], optimizer: Any, batches: list[dict]) -> dict[str, float]:
    evaluated = global_loss(run_forward_backward(chunks, local_batches(batches), forward_only=True))
    trained, grad_norm = train_step(chunks, optimizer, local_batches(batches))
    after = global_loss(run_forward_backward(chunks, local_batches(batches), forward_only=True))
    return {"eval loss": evaluated, "train loss": trained, "grad norm": grad_norm, "loss after step": after}


def _check(rank: int, world_size: int, directory: str) -> list[dict[str, Any]]:
    from megatron.core import dist_checkpointing

    from mindspeed.megatron import adapt, unadapt

    adapt()
    try:
        steps = [make_batches(MODEL, NUM_MICROBATCHES, MICRO_BATCH_SIZE, seed=step) for step in range(3)]
        chunks, optimizer = _setup(ParallelSizes())  # TP1 / DP2
        broadcast_state(chunks)
        for batches in steps[:2]:
            train_step(chunks, optimizer, local_batches(batches))
        with _children_allowed():
            dist_checkpointing.save(
                _sharded_state(chunks, optimizer, is_loading=False), directory, async_sharded_save=False
            )
        saved = full_state(chunks)
        reference = _next_batch(chunks, optimizer, steps[2])
        continued = full_state(chunks)
        destroy_parallel()
        summaries = []
        for label, sizes in LOAD_LAYOUTS.items():
            chunks, optimizer = _setup(sizes)
            state = dist_checkpointing.load(_sharded_state(chunks, optimizer, is_loading=True), directory)
            unwrap(chunks[0]).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            comparison = Comparison(label)
            compare_with_full(chunks, MODEL, saved, comparison, read=lambda p: p, prefix="loaded")
            for name, value in _next_batch(chunks, optimizer, steps[2]).items():
                comparison.add(name, value, reference[name], atol=1e-5, rtol=1e-6)
            compare_with_full(chunks, MODEL, continued, comparison, read=lambda p: p, prefix="stepped")
            comparison.extra.update(
                reference_names=sorted(saved), moved=min((continued[n] - saved[n]).abs().max().item() for n in saved)
            )
            summaries.append(comparison.summary())
            destroy_parallel()
    finally:
        unadapt()
    return summaries


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory: Path = tmp_path_factory.mktemp("megatron_ckpt")
    per_rank = run_distributed(_check, 2, str(directory), timeout=600)
    return merge_summaries(per_rank)


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(LOAD_LAYOUTS))
def test_resume_at_another_layout(results: dict[str, Any], label: str) -> None:
    layout = results[label]
    assert not layout["failures"], f"loaded at {label}, differs from the saved run:\n" + "\n".join(layout["failures"])
    expected = {f"{prefix} {name}" for prefix in ("loaded", "stepped") for name in layout["reference_names"]}
    expected |= {"eval loss", "train loss", "grad norm", "loss after step"}
    assert layout["names"] == expected, f"{label}: not compared {sorted(expected - layout['names'])}"
    assert layout["moved"] > 0, "the step after the load changed nothing: the optimizer state went unchecked"
