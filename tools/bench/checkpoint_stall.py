"""Benchmark the training stall per checkpoint save: synchronous vs ``checkpoint.async_save``.

Each variant is a fresh ``pretrain`` on one rank (the tiny_cpu recipe's shape, or ``--size small``:
8 layers, hidden 512) over the shipped demo corpus, saving every ``--interval`` steps:

- ``no saves``: the same run with no checkpoint (no interval, no save at the end; the baseline of the
  whole-run columns);
- ``sync``: each save blocks the step for planning, writing and completing the checkpoint;
- ``async``: each save blocks only for planning and staging (a host copy of the state); the files
  are written by a background thread while the next steps train, and completed at a later step.

The stall is the time the training thread spends in the trainer's save calls (the save itself, and
for async the per-step poll and the wait that completes a save): wall time and the training
thread's own CPU time, per save. The whole-run columns (wall and CPU time of the process, all
threads, over the baseline's) show what the background writing still costs: on a machine whose
cores are all training, the writer competes with the step. The load average is recorded around
every run (rows marked noisy above ``--max-load``). Usage::

    uv run --frozen python tools/bench/checkpoint_stall.py                 # tiny shape
    uv run --frozen python tools/bench/checkpoint_stall.py --size small    # 8 layers, hidden 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from _child import LoadRecord

SIZES = {
    "tiny": {},
    "small": {
        "model.num_layers": 8,
        "model.hidden_size": 512,
        "model.ffn_hidden_size": 1408,
        "model.num_attention_heads": 8,
        "model.num_query_groups": 4,
    },
}
#: (steps, save interval) of each size.
STEPS = {"tiny": (40, 5), "small": (12, 3)}
VARIANTS = ("no saves", "sync", "async")
_SAVE_CALLS = ("_save", "_poll_save", "_wait_for_save")


def _timed_saves() -> list[tuple[float, float]]:
    """Wrap the trainer's save calls: each call's (wall, training-thread CPU) seconds lands in the list."""
    from mindspeed_llm.training.trainer_save import TrainerSaving

    spent: list[tuple[float, float]] = []
    for name in _SAVE_CALLS:
        original = getattr(TrainerSaving, name)

        def timed(self: Any, _original: Any = original) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return _original(self)
            finally:
                spent.append((time.perf_counter() - wall, time.thread_time() - cpu))

        setattr(TrainerSaving, name, timed)
    return spent


def _child_run(spec: dict[str, Any]) -> dict[str, Any]:
    from mindspeed.launch import launch
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.quickstart import TINY_CPU_RECIPE, prepare_demo_data
    from mindspeed_llm.training.trainer import pretrain

    out = Path(spec["out"])
    steps, interval = STEPS[spec["size"]]
    saves = spec["variant"] != "no saves"
    overrides = [
        f"data.prefixes=[{prepare_demo_data(Path(spec['data']))}]",
        f"train.steps={steps}",
        "train.lr_warmup_steps=2",
        "eval.interval=null",
        "eval.at_end=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        f"checkpoint.save={out / 'ckpt'}",  # the baseline too: the same run report and metrics files
        f"checkpoint.interval={interval if saves else 'null'}",
        f"checkpoint.save_at_end={str(saves).lower()}",
        "checkpoint.keep_last=null",
        f"checkpoint.async_save={str(spec['variant'] == 'async').lower()}",
        *(f"{key}={value}" for key, value in SIZES[spec["size"]].items()),
    ]
    config = load_pretrain_config(TINY_CPU_RECIPE, overrides)
    spent = _timed_saves()
    load = [_child.load_average()]
    wall, cpu = time.perf_counter(), time.process_time()
    launch(pretrain, (config,), 1)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    load.append(_child.load_average())
    return {
        "saves": steps // interval if saves else 0,
        "stall_wall_s": sum(w for w, _ in spent),
        "stall_cpu_s": sum(c for _, c in spent),
        "run_wall_s": wall,
        "run_cpu_s": cpu,
        "load": load,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", default=None, help=argparse.SUPPRESS)
    _child.add_record_args(parser)
    args = parser.parse_args()
    if args.child:
        return _child.child_main({"run": _child_run}, args.child, args.child_spec)
    from rich.console import Console

    record = LoadRecord(args.max_load)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as tmp:
        root = Path(tmp)
        for repeat in range(args.repeats):
            for variant in VARIANTS:  # alternating, so that a busy spell does not hit one variant only
                out = root / f"{variant.replace(' ', '_')}{repeat}"
                spec = {
                    "variant": variant,
                    "size": args.size,
                    "out": str(out),
                    "data": str(root),
                    "threads": args.threads,
                }
                runs[variant].append(_child.run_child(__file__, "run", spec, root / f"{out.name}.log"))
    base = statistics.median(r["run_wall_s"] for r in runs["no saves"])
    base_cpu = statistics.median(r["run_cpu_s"] for r in runs["no saves"])
    rows = []
    for variant in VARIANTS:
        rs, saves = runs[variant], runs[variant][0]["saves"]
        per = (lambda key: statistics.median(r[key] for r in rs) / saves * 1e3) if saves else (lambda key: 0.0)
        rows.append(
            [
                variant,
                str(saves),
                f"{per('stall_wall_s'):.0f}" if saves else "-",
                f"{per('stall_cpu_s'):.0f}" if saves else "-",
                f"{statistics.median(r['run_wall_s'] for r in rs):.2f} (+{statistics.median(r['run_wall_s'] for r in rs) - base:.2f})",
                f"{statistics.median(r['run_cpu_s'] for r in rs):.2f} (+{statistics.median(r['run_cpu_s'] for r in rs) - base_cpu:.2f})",
                "-".join(f"{x:.1f}" for x in _child.load_range(rs)),
            ]
        )
    steps, interval = STEPS[args.size]
    columns = ["variant", "saves", "stall/save ms (wall)", "stall/save ms (CPU)", "run wall s", "run CPU s", "load"]
    title = (
        f"checkpoint stall, {args.size} shape, {steps} steps, a save every {interval}, {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    table = _child.render(Console(stderr=True), title, columns, rows, record)
    return _child.finish(record, args.table, table)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
