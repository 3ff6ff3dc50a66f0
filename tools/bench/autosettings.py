"""Auto-settings' predictions against measured runs: peak memory and the step-time ranking of layouts.

Two gloo ranks train the small GPT of ``tests/core/autosettings/test_measured.py`` (4 layers,
hidden 128, SwiGLU 512, 4 heads / 2 groups, vocabulary 1024; here 256 tokens, a batch of 8
sequences, fp32) on each layout and memory setting below, in rounds (each round builds every
layout afresh and times a few steps, so a change of the machine's load shifts all layouts
alike). Per layout: the measured device-pool peak (largest rank) against
:func:`mindspeed.autosettings.estimate_memory`, and the median step time (wall, and process CPU
time, largest rank; and the minimum, the least disturbed step, which is the steadier measure on a
shared machine) against :func:`mindspeed.autosettings.steptime.estimate_step_time`.

The time model needs the "device": the ranks measure it first, as a user would read a
datasheet: one thread's fp32 matmul rate (the peak), a copy's rate (memory and host
bandwidth: on the CPU they are the same memory), a gloo all-reduce's rate (the link) and a
one-element all-reduce's time (the latency). The
ranking is scored as the fraction of layout pairs whose predicted order matches the measured
one (pairs measured within 3 % of each other, or predicted within 0.5 %, are ties and left out).
``--replay FILE`` re-predicts from a ``--json`` file's measurements.

Usage::

    uv run --frozen python tools/bench/autosettings.py [--rounds 3] [--json autosettings.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from mindspeed.autosettings import ClusterSpec, Layout, estimate_memory, job_from_recipe
from mindspeed.autosettings.memory import stage_params
from mindspeed.autosettings.steptime import estimate_step_time
from mindspeed.testing.distributed import run_distributed

RECIPE: dict[str, Any] = {
    "model": {
        "num_layers": 4,
        "hidden_size": 128,
        "ffn_hidden_size": 512,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "vocab_size": 1024,
    },
    "data": {"seq_length": 256},
    "train": {"micro_batch_size": 1, "global_batch_size": 8, "precision": "fp32"},
}

LAYOUTS: list[Layout] = [
    Layout(dp=2),
    Layout(dp=2, micro_batch_size=2),
    Layout(tp=2, sequence_parallel=True),
    Layout(pp=2),
    Layout(pp=2, vpp=2),
    Layout(dp=2, recompute="selective"),
    Layout(dp=2, recompute="full", recompute_layers=2),
    Layout(dp=2, recompute="full", recompute_layers=4),
    Layout(dp=2, recompute_activation=True),
    Layout(dp=2, recompute_norm=True),
    Layout(dp=2, swap_attention=True),
    Layout(dp=2, distributed_optimizer=True, swap_optimizer=True),
]


def _device(rank: int, world_size: int) -> dict[str, float]:
    """This machine as a device: matmul TFLOP/s, copy GB/s, all-reduce GB/s."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(512, 512), torch.randn(512, 1024)
    a @ b
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    tflops = 2 * 512 * 512 * 1024 * reps / (time.perf_counter() - start) / 1e12
    x = torch.randn(4 << 20)
    y = x.clone()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    copy = 2 * x.numel() * 4 * 10 / (time.perf_counter() - start) / 1e9
    z = torch.randn(2 << 20)
    dist.all_reduce(z)
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(z)
    link = z.numel() * 4 * 5 / (time.perf_counter() - start) / 1e9
    tiny = torch.zeros(1)
    dist.all_reduce(tiny)
    start = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(tiny)
    latency = (time.perf_counter() - start) / 50
    return {"tflops": tflops, "copy_gbps": copy, "link_gbps": link, "latency_s": latency}


def _rank(rank: int, world_size: int, rounds: int, steps: int) -> dict[str, Any]:
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.testing.autosettings import measure_layout

    adapt("cpu")
    try:
        device = _device(rank, world_size)
        job = job_from_recipe(RECIPE)
        peaks = [0] * len(LAYOUTS)
        wall: list[list[float]] = [[] for _ in LAYOUTS]
        cpu: list[list[float]] = [[] for _ in LAYOUTS]
        for round_index in range(rounds):
            for index, layout in enumerate(LAYOUTS):
                measured = measure_layout(job, layout, steps=2 if round_index == 0 else 1, timed_steps=steps)
                if round_index == 0:
                    peaks[index] = measured.peak_bytes
                wall[index] += measured.wall_s
                cpu[index] += measured.cpu_s
        return {"device": device, "peaks": peaks, "wall": wall, "cpu": cpu}
    finally:
        unadapt()


def _agreement(predicted: list[float], measured: list[float], tie: float = 0.03) -> tuple[int, int]:
    """Pairs whose predicted order is the measured one, and pairs compared: pairs measured within
    ``tie`` of each other, or predicted within 0.5 % (the model sees no order), are left out."""
    agree = total = 0
    for i, j in itertools.combinations(range(len(predicted)), 2):
        if abs(measured[i] - measured[j]) <= tie * min(measured[i], measured[j]):
            continue
        if abs(predicted[i] - predicted[j]) <= 0.005 * min(predicted[i], predicted[j]):
            continue
        total += 1
        agree += (predicted[i] < predicted[j]) == (measured[i] < measured[j])
    return agree, total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all layouts (default 3)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout and round (default 2)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--replay", default="", help="take the measurements from this --json file (re-predict only)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.replay:
        with open(args.replay) as file:
            saved = json.load(file)
        device, measured = saved["device"], saved["rows"]
    else:
        per_rank = run_distributed(_rank, 2, args.rounds, args.steps, timeout=3600)
        device = {key: min(r["device"][key] for r in per_rank) for key in per_rank[0]["device"]}
        device["latency_s"] = max(r["device"]["latency_s"] for r in per_rank)
        measured = [
            {
                "measured_mib": max(r["peaks"][index] for r in per_rank) / 2**20,
                "wall_ms": max(statistics.median(r["wall"][index]) for r in per_rank) * 1e3,
                "cpu_ms": max(statistics.median(r["cpu"][index]) for r in per_rank) * 1e3,
                "cpu_min_ms": max(min(r["cpu"][index]) for r in per_rank) * 1e3,
                "wall_min_ms": max(min(r["wall"][index]) for r in per_rank) * 1e3,
            }
            for index in range(len(LAYOUTS))
        ]
    job = job_from_recipe(RECIPE)
    cluster = ClusterSpec(
        nnodes=1,
        nproc_per_node=2,
        device_memory_bytes=1 << 40,
        peak_tflops=device["tflops"],
        link_gbps=device["link_gbps"],
        host_gbps=device["copy_gbps"],
        memory_gbps=device["copy_gbps"],
        mfu=1.0,
        async_copies=False,
        latency_s=device.get("latency_s", 0.0),
    )
    rows = []
    for index, layout in enumerate(LAYOUTS):
        memory = estimate_memory(job, layout)
        params = max(stage_params(job, layout, stage)[0] for stage in {0, layout.pp - 1})
        predicted = estimate_step_time(job, layout, cluster, params).total
        rows.append(
            {
                "layout": layout.label(),
                "measured_mib": measured[index]["measured_mib"],
                "predicted_mib": memory.peak / 2**20,
                "wall_ms": measured[index]["wall_ms"],
                "cpu_ms": measured[index]["cpu_ms"],
                "cpu_min_ms": measured[index].get("cpu_min_ms", float("nan")),
                "wall_min_ms": measured[index].get("wall_min_ms", float("nan")),
                "predicted_ms": predicted * 1e3,
            }
        )
    print(
        f"device as measured: {device['tflops'] * 1e3:.1f} GFLOP/s matmul, {device['copy_gbps']:.2f} GB/s copy, "
        f"{device['link_gbps']:.2f} GB/s gloo all-reduce; load average {os.getloadavg()[0]:.1f}; "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(
        f"{'layout':<44}{'meas MiB':>10}{'pred MiB':>10}{'err':>8}{'wall ms':>10}{'cpu ms':>10}"
        f"{'min wall':>10}{'min cpu':>10}{'pred ms':>10}"
    )
    for row in rows:
        err = row["predicted_mib"] / row["measured_mib"] - 1
        print(
            f"{row['layout']:<44}{row['measured_mib']:>10.2f}{row['predicted_mib']:>10.2f}{err:>+8.1%}"
            f"{row['wall_ms']:>10.1f}{row['cpu_ms']:>10.1f}{row['wall_min_ms']:>10.1f}{row['cpu_min_ms']:>10.1f}"
            f"{row['predicted_ms']:>10.1f}"
        )
    predicted = [r["predicted_ms"] for r in rows]
    scores = {}
    for key in ("wall_ms", "cpu_ms", "wall_min_ms", "cpu_min_ms"):
        agree, total = _agreement(predicted, [r[key] for r in rows])
        scores[key] = (agree, total)
        name = key[:-3].replace("_", " ")
        print(f"ranking vs {name} time: {agree} of {total} pairs agree ({agree / max(1, total):.0%})")
    if args.json:
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as out:
            json.dump({"device": device, "rows": rows, "agreement": scores}, out, indent=2)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
