"""Per-rank peak memory and step time of ``examples/llm/long_seq_cp2.yaml`` at CP = 1 and CP = 2.

For every CP degree one group of ``cp`` real ranks (gloo on the CPU) runs
``mindspeed-llm pretrain``'s trainer on the recipe (its ``parallel.cp`` replaced, the demo
corpus tokenized into a temporary directory, no checkpoints), and every rank measures each
training step with :func:`mindspeed.metrics.measure_peak_memory` (allocator counters on a
device, dispatch tracking on the CPU): the peak tensor bytes the step adds above what was live
before it (weights, gradient buffers and, after step 1, Adam's state). The table shows the last
step (step 1 also allocates Adam's state), the largest rank, and the ratio to CP = 1.

Usage::

    uv run --frozen python tools/bench/long_seq.py
    uv run --frozen python tools/bench/long_seq.py --seq-length 8192 --cp 1,2 --steps 2 key=value ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mindspeed.testing.distributed import run_distributed

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "llm" / "long_seq_cp2.yaml"


def _rank(rank: int, world_size: int, overrides: list[str]) -> list[dict[str, Any]]:
    import mindspeed_llm.training.trainer as trainer_module
    from mindspeed.metrics import measure_peak_memory
    from mindspeed_llm.training.config import load_pretrain_config

    steps: list[dict[str, Any]] = []

    class Measured(trainer_module.Trainer):
        def _step(self, state: Any, gbs: int, num_micro: int) -> dict[str, Any]:
            start = time.perf_counter()
            with measure_peak_memory() as peak:
                record = super()._step(state, gbs, num_micro)
            steps.append(
                {
                    "step": record["step"],
                    "loss": record["loss"],
                    "peak_mib": peak.peak_mib,
                    "method": peak.method,
                    "seconds": time.perf_counter() - start,
                }
            )
            return record

    trainer_module.Trainer = Measured
    trainer_module.pretrain(load_pretrain_config(RECIPE, overrides))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", default="1,2", help="CP degrees, one group of that many ranks each")
    parser.add_argument("--seq-length", type=int, default=None, help="override data.seq_length")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="more recipe overrides, key=value")
    args = parser.parse_args(argv)
    from mindspeed_llm.training.quickstart import prepare_demo_data

    with tempfile.TemporaryDirectory() as root:
        data = prepare_demo_data(Path(root))
        common = [
            f"data.prefixes=[{data}]",
            f"train.steps={args.steps}",
            "train.lr_warmup_steps=0",
            "checkpoint.save=null",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.loss_curve=false",
            f"data.cache_dir={root}/cache",
            *args.overrides,
        ]
        if args.seq_length:
            common.append(f"data.seq_length={args.seq_length}")
        rows = []
        for cp in (int(x) for x in args.cp.split(",")):
            started = time.perf_counter()
            per_rank = run_distributed(_rank, cp, [*common, f"parallel.cp={cp}"], timeout=3600)
            last = [steps[-1] for steps in per_rank]
            rows.append(
                {
                    "cp": cp,
                    "peak_mib": max(r["peak_mib"] for r in last),
                    "loss": last[0]["loss"],
                    "seconds": max(r["seconds"] for r in last),
                    "method": last[0]["method"],
                    "wall": time.perf_counter() - started,
                }
            )
    base = rows[0]["peak_mib"]
    print(f"{'cp':>3} {'peak MiB/rank':>14} {'vs first':>9} {'step s':>8} {'loss':>8}  method")
    for r in rows:
        print(
            f"{r['cp']:>3} {r['peak_mib']:>14.1f} {r['peak_mib'] / base:>9.3f} {r['seconds']:>8.1f} "
            f"{r['loss']:>8.4f}  {r['method']}"
        )
    return 0


if __name__ == "__main__":
    import _child  # tools/bench/_child.py: the load average before and after, and the verdict

    sys.exit(_child.main_with_load_record(main))
