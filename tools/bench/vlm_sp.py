"""Ulysses SP2 against DP2 on two gloo ranks: losses, per-rank peak RSS and CPU seconds of ``mindspeed-mm train``.

Both runs train the Qwen2.5-VL of ``tools/bench/vlm.py`` (built here) on its data, with the
same samples per step: DP2 gives each rank its own microbatch of ``--micro-batch`` packed
samples, SP2 gives both ranks the same two microbatches (accumulated) and splits each row's
language-model sequence between them (and the images' encoding). Usage::

    uv run --frozen python tools/bench/vlm_sp.py --micro-batch 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _child import memory_status
from vlm import write_data, write_model


def rank_run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """One rank: train, then its CPU seconds and peak RSS."""
    import torch

    torch.set_num_threads(1)
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.trainer.loop import train

    start = time.process_time()
    records = train(load_mm_config(None, overrides)).records
    return {
        "losses": [r["loss"] for r in records],
        "tokens": [r["tokens"] for r in records],
        "cpu_s": time.process_time() - start,
        **memory_status(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run DP2 then SP2 and print one JSON line per rank and run."""
    from mindspeed.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=8, help="samples packed per microbatch (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--workdir", default=None, help="model and data (default: a temporary directory)")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-vlm-sp-"))
    if not (work / "model" / "config.json").is_file():
        write_model(work / "model", "small")
        write_data(work / "data", 64, 1234, "mixed")
    for sp in (1, 2):
        overrides = [
            f"model.path={work / 'model'}",
            f"data.files=[{work / 'data' / 'data.jsonl'}]",
            f"train.steps={args.steps}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.gradient_accumulation_steps={sp}",
            f"parallel.ulysses_parallel_size={sp}",
            "train.precision=fp32",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.loss_curve=false",
            f"data.image_max_pixels={448 * 448}",
        ]
        for rank, out in enumerate(run_distributed(rank_run, 2, overrides, timeout=1800)):
            sys.stdout.write(
                json.dumps(
                    {
                        "run": f"{'SP' if sp > 1 else 'DP'}2",
                        "rank": rank,
                        "peak_rss_mb": round(out["peak_rss_mb"]),
                        "cpu_s": round(out["cpu_s"], 1),
                        "losses": [round(x, 4) for x in out["losses"]],
                        "tokens": out["tokens"],
                    }
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    import _child  # tools/bench/_child.py: the load average before and after, and the verdict

    sys.exit(_child.main_with_load_record(main))
