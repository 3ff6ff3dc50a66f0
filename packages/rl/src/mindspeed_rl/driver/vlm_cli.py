"""``mindspeed-rl grpo`` for a vision-language recipe (``actor.model_type: vlm``): one process, no Ray.

The metrics go where a text run writes them (``logging.dir``: ``metrics.jsonl``, TensorBoard,
``reward.png``, the held-out answers as a table), one line a step on the console, and the summary
line ``N steps: reward a -> b, held-out c -> d``.
"""

from __future__ import annotations

import sys

from mindspeed.config import to_dict
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.driver.metrics import ProgressLine, RLMetricsLog
from mindspeed_rl.driver.vlm_trainer import train_vlm_grpo


def run_vlm_grpo(config: GRPOConfig) -> int:
    """Run a vision-language recipe; returns the exit status (0)."""
    log_dir = config.log_dir()
    sink = RLMetricsLog(
        log_dir, reward_curve=config.logging.reward_curve, settings=config.logging, config=to_dict(config)
    )
    progress = ProgressLine(config.train.steps, bar=config.logging.progress, interval=config.logging.interval)
    held_out: list[float] = []

    def on_step(record: dict[str, float]) -> None:
        if "eval/reward_mean" in record:
            held_out.append(record["eval/reward_mean"])
        if record.get("step", 0.0) > 0:
            progress.update(record)
        sink.log(record)

    try:
        records = train_vlm_grpo(config, on_step, sink.log_samples)
    finally:
        progress.close()
        curve = sink.close()
    first, last = records[0], records[-1]
    sys.stdout.write(
        f"{len(records)} steps: reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}"
        + (f", held-out {held_out[0]:.3f} -> {held_out[-1]:.3f}" if len(held_out) > 1 else "")
        + (f"; metrics in {log_dir}" if log_dir else "")
        + (f", curve {curve}" if curve else "")
        + "\n"
    )
    return 0
