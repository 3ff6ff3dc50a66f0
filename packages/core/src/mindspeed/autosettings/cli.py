"""``mindspeed auto-settings``: read a recipe, search, print the best layouts, write the best one's recipe."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mindspeed.autosettings.spec import ClusterSpec, job_from_recipe, parse_device
from mindspeed.config import merge

if TYPE_CHECKING:
    from mindspeed.autosettings.search import Candidate

_GIB = float(1 << 30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags."""
    parser.add_argument("--config", required=True, help="the mindspeed-llm recipe (YAML) to lay out")
    parser.add_argument("--nnodes", type=int, required=True, help="nodes of the target cluster")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="devices per node")
    parser.add_argument("--device-memory", type=float, required=True, help="memory of one device, GiB")
    parser.add_argument(
        "--device",
        default=None,
        help="PEAK_TFLOPS,LINK_GBPS[,HOST_GBPS] of one device (default: this machine's accelerator's peak, 100 GB/s links)",
    )
    parser.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    parser.add_argument(
        "--memory-margin", type=float, default=0.1, help="fraction of the device memory kept free (default 0.1)"
    )
    parser.add_argument(
        "--output",
        default="auto_settings.yaml",
        help="where the best layout's recipe goes (default auto_settings.yaml)",
    )
    parser.add_argument("--json", action="store_true", help="print the candidates as JSON")


def _read_recipe(path: str) -> Mapping[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path!r} does not exist; give a mindspeed-llm recipe YAML")
    try:
        recipe = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path!r} is not valid YAML: {err}") from err
    if not isinstance(recipe, Mapping):
        raise ValueError(f"--config {path!r} must hold a mapping at the top level")
    return recipe


def cluster_from_args(args: argparse.Namespace, precision: str) -> ClusterSpec:
    """The :class:`ClusterSpec` of the flags.

    Raises:
        ValueError: a flag out of range, or no ``--device`` where the local peak is unknown.
    """
    for flag, value in (("--nnodes", args.nnodes), ("--nproc-per-node", args.nproc_per_node)):
        if value < 1:
            raise ValueError(f"{flag}={value} must be at least 1")
    if not args.device_memory > 0:
        raise ValueError(f"--device-memory={args.device_memory} must be a positive number of GiB, e.g. 64")
    if not 0 <= args.memory_margin < 1:
        raise ValueError(f"--memory-margin={args.memory_margin} must be in [0, 1), e.g. 0.1")
    if args.top < 1:
        raise ValueError(f"--top={args.top} must be at least 1")
    extra: dict[str, Any] = {}
    if args.device is not None:
        peak, link, host = parse_device(args.device)
        extra.update(peak_tflops=peak, link_gbps=link)
        if host is not None:
            extra["host_gbps"] = host
    else:
        from mindspeed.metrics.peak import peak_flops

        found = peak_flops(precision)
        if found is None:
            raise ValueError("the peak of this machine's accelerator is unknown; give --device PEAK_TFLOPS,LINK_GBPS")
        extra.update(peak_tflops=found.tflops, link_gbps=100.0)
    return ClusterSpec(
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        device_memory_bytes=int(args.device_memory * _GIB),
        **extra,
    )


def write_recipe(path: str | Path, recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """Write the recipe with ``overrides`` merged in (a temporary name, then renamed)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(yaml.safe_dump(merge(dict(recipe), overrides), sort_keys=False))
    os.replace(tmp, target)


def dotted_overrides(overrides: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``overrides`` as the ``key=value`` arguments of ``mindspeed-llm pretrain --config RECIPE ...``."""
    out = []
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            out += dotted_overrides(value, f"{prefix}{key}.")
        else:
            out.append(
                f"{prefix}{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            )
    return out


#: The c10d rendezvous of a multi-node launch: the first node's address (set MASTER_ADDR there and on every node).
RENDEZVOUS = "$MASTER_ADDR:29500"


def launch_commands(recipe: str | Path, nnodes: int, nproc_per_node: int, parallel: Mapping[str, Any]) -> list[str]:
    """The command lines that train ``recipe`` on ``nnodes`` x ``nproc_per_node`` devices with the layout ``parallel``.

    One node: our launcher (``--nproc-per-node``) and the same under ``torchrun --standalone``.
    Several nodes: ``torchrun`` on every node with the c10d rendezvous at :data:`RENDEZVOUS`
    (our launcher spawns one node's ranks only). The layout's sizes are spelled out as overrides
    (``parallel.tp=...``) though the written recipe holds them too, so the line shows the layout.
    """
    sizes = [f"parallel.{key}={parallel[key]}" for key in ("tp", "pp") if key in parallel]
    sizes += [f"parallel.{key}={parallel[key]}" for key in ("vpp", "cp", "ep") if parallel.get(key) not in (None, 0, 1)]
    command = ["pretrain", "--config", str(recipe), *sizes]
    if nnodes == 1:
        return [
            shlex.join(["mindspeed-llm", command[0], "--nproc-per-node", str(nproc_per_node), *command[1:]]),
            shlex.join(
                [
                    "torchrun",
                    "--standalone",
                    "--nproc-per-node",
                    str(nproc_per_node),
                    "-m",
                    "mindspeed_llm.cli",
                    *command,
                ]
            ),
        ]
    torchrun = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", RENDEZVOUS, "-m", "mindspeed_llm.cli"]
    return [shlex.join(torchrun + command).replace(shlex.quote(RENDEZVOUS), f'"{RENDEZVOUS}"')]


def _row(rank: int, candidate: Candidate) -> dict[str, Any]:
    mem, time = candidate.memory, candidate.time
    return {
        "rank": rank,
        "layout": candidate.layout.label(),
        "peak_gib": round(mem.peak / _GIB, 3),
        "weights_gib": round(mem.weights / _GIB, 3),
        "grads_gib": round(mem.grads / _GIB, 3),
        "optimizer_gib": round(mem.optimizer / _GIB, 3),
        "activations_gib": round(max(mem.activations, mem.step) / _GIB, 3),
        "step_s": round(time.total, 6),
        "compute_s": round(time.compute, 6),
        "communication_s": round(time.communication + time.data_parallel, 6),
        "bubble_s": round(time.bubble, 6),
    }


def run_auto_settings(args: argparse.Namespace) -> int:
    """Search the recipe's layouts on the cluster; print the best, write the best one's recipe."""
    # Here, not at the top: the FLOPs counter's package imports torch, which `mindspeed --help` need not load.
    from mindspeed.autosettings.search import search

    recipe = _read_recipe(args.config)
    world = args.nnodes * args.nproc_per_node
    job = job_from_recipe(recipe, world_size=world if world > 0 else None)
    cluster = cluster_from_args(args, job.precision)
    best, count = search(job, cluster, top=args.top, margin=args.memory_margin)
    layers_per_chunk = job.shape.num_layers // (best[0].layout.pp * best[0].layout.chunks)
    overrides = best[0].layout.overrides(job.global_batch_size, layers_per_chunk)
    write_recipe(args.output, recipe, overrides)
    rows = [_row(rank, c) for rank, c in enumerate(best, 1)]
    dotted = dotted_overrides(overrides)
    launch = launch_commands(args.output, args.nnodes, args.nproc_per_node, overrides["parallel"])
    if args.json:
        print(
            json.dumps(
                {
                    "evaluated": count,
                    "output": str(args.output),
                    "overrides": dotted,
                    "launch": launch,
                    "candidates": rows,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"auto-settings: {count} layouts of {job.shape.num_layers} layers x {job.shape.hidden_size} on "
        f"{cluster.nnodes} x {cluster.nproc_per_node} devices of {cluster.device_memory_bytes / _GIB:.3g} GiB, "
        f"{cluster.peak_tflops:.4g} TFLOP/s, {cluster.link_gbps:.4g} GB/s; batch {job.global_batch_size} x "
        f"{job.seq_length} tokens ({job.precision})"
    )
    print(f"{'#':<3}{'layout':<64}{'peak GiB':>10}{'step s':>12}{'compute':>10}{'comm':>10}{'bubble':>10}")
    for row in rows:
        print(
            f"{row['rank']:<3}{row['layout']:<64}{row['peak_gib']:>10.3f}{row['step_s']:>12.4g}"
            f"{row['compute_s']:>10.3g}{row['communication_s']:>10.3g}{row['bubble_s']:>10.3g}"
        )
    print(f"overrides of the best: {' '.join(dotted)}")
    print(f"wrote {args.output} (the recipe with the best layout: mindspeed-llm pretrain --config {args.output})")
    layout = best[0].layout
    print(
        f"launch ({world} ranks: tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp {layout.dp}"
        + ("" if args.nnodes == 1 else "; on every node, MASTER_ADDR = the first node's address")
        + "; docs/scale-out.md):"
    )
    for line in launch:
        print(f"  {line}")
    return 0
