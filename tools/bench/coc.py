"""Benchmark compute-communication overlap (the ``coc`` feature): step time with and without it.

Two ranks (gloo on the CPU) train a GPT at TP2 + sequence parallelism, once with megatron's
linears and once per ``coc_parallel_num`` with the CoC linears (the chunked pipeline), the
variants round-robin so machine load hits each alike. Reported per variant: the median wall
time per step and the median process (CPU) time per step of rank 0.

Usage::

    uv run --frozen python tools/bench/coc.py
    uv run --frozen python tools/bench/coc.py --hidden 512 --seq 1024 --chunks 2,4,8 --rounds 3

On a CPU host gloo's collectives and the GEMMs share the same cores, so there is little to
overlap: the numbers show the pipeline's cost (more, smaller GEMMs and collectives), not its
gain, which needs a device whose communication runs beside its compute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from mindspeed.testing.distributed import run_distributed


def _build(args: Any, chunks: int) -> tuple[Any, Any, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.testing.megatron import ParallelSizes, TinyGPTConfig, build_gpt, local_batches, make_batches

    model = TinyGPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=8,
        num_query_groups=8,
        seq_length=args.seq,
    )
    kernels: dict[str, str] = {"attention": "auto"}
    if chunks:
        kernels.update(all_gather_matmul="chunked", matmul_reduce_scatter="chunked")
    chunks_ = build_gpt(
        model, ParallelSizes(tp=2, sequence_parallel=True), layer_spec=get_gpt_layer_spec(kernels, swiglu=False)
    )
    for chunk in chunks_:
        for module in chunk.modules():
            if hasattr(module, "coc_num_chunks"):
                module.coc_num_chunks = chunks
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), chunks_)
    return chunks_, optimizer, local_batches(make_batches(model, 1, args.micro_batch))


def _rank(rank: int, world_size: int, args: Any) -> dict[str, list[float]]:
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.testing.megatron import ParallelSizes, destroy_parallel, init_parallel, train_step

    torch.set_num_threads(1)
    adapt("cpu")
    variants = [0, *args.chunks]
    times: dict[str, list[float]] = {f"{v}:{k}": [] for v in variants for k in ("wall", "cpu")}
    try:
        for _ in range(args.rounds):
            for chunks in variants:
                init_parallel(ParallelSizes(tp=2, sequence_parallel=True))
                try:
                    model, optimizer, batches = _build(args, chunks)
                    train_step(model, optimizer, batches)  # warm-up
                    for _ in range(args.steps):
                        wall, cpu = time.perf_counter(), time.process_time()
                        train_step(model, optimizer, batches)
                        times[f"{chunks}:wall"].append(time.perf_counter() - wall)
                        times[f"{chunks}:cpu"].append(time.process_time() - cpu)
                finally:
                    destroy_parallel()
    finally:
        unadapt()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times = run_distributed(_rank, 2, args, timeout=1800)[0]
    base = statistics.median(times["0:wall"]), statistics.median(times["0:cpu"])
    print("| CoC | wall ms/step | wall / off | CPU ms/step (rank 0) | CPU / off |")
    print("| --- | --- | --- | --- | --- |")
    for chunks in [0, *args.chunks]:
        wall, cpu = statistics.median(times[f"{chunks}:wall"]), statistics.median(times[f"{chunks}:cpu"])
        name = "off" if chunks == 0 else f"on, coc_parallel_num={chunks}"
        print(f"| {name} | {wall * 1e3:,.0f} | {wall / base[0]:.2f}x | {cpu * 1e3:,.0f} | {cpu / base[1]:.2f}x |")


if __name__ == "__main__":
    main()
