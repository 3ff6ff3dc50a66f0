"""``mindspeed-rl grpo`` for a vision-language recipe (``actor.model_type: vlm``): one process, no Ray.

The run holds ``checkpoint.save``'s run lock and runs as one rank of a process group started by
the core's launcher (:func:`mindspeed.launch.launch`; the checkpoints are collectives). It resumes
from the newest complete checkpoint in ``checkpoint.save`` (the same command continues a stopped
run), saves every ``checkpoint.interval`` steps and after the last, and writes the policy to
``checkpoint.save_hf`` at the end (:mod:`mindspeed_rl.driver.vlm_checkpoint`).

The metrics go where a text run writes them (``logging.dir``: ``metrics.jsonl``, TensorBoard,
``reward.png``, the held-out answers as a table; a resumed run drops the records after its
checkpoint's step), one line a step on the console, and the summary line
``N steps: reward a -> b, held-out c -> d``.
"""

from __future__ import annotations

import sys

from mindspeed.checkpointing import run_lock
from mindspeed.config import to_dict
from mindspeed.launch import launch
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.driver.metrics import ProgressLine, RLMetricsLog
from mindspeed_rl.driver.vlm_trainer import run_vlm_steps, start_vlm_run


def run_vlm_grpo(config: GRPOConfig) -> int:
    """Run a vision-language recipe; returns the exit status (0)."""
    with run_lock(config.checkpoint.save):
        return launch(_vlm_rank, (config,), nproc_per_node=1)


def _vlm_rank(config: GRPOConfig) -> int:
    """The run on this rank: build and resume, step with the metrics log, write the summary line."""
    run = start_vlm_run(config)
    config = run.ctx.config
    log_dir = config.log_dir()
    sink = RLMetricsLog(
        log_dir,
        reward_curve=config.logging.reward_curve,
        resume_step=run.ctx.step,
        settings=config.logging,
        config=to_dict(config),
    )
    progress = ProgressLine(
        config.train.steps, bar=config.logging.progress, interval=config.logging.interval, start=run.ctx.step
    )
    held_out: list[float] = []

    def on_step(record: dict[str, float]) -> None:
        if "eval/reward_mean" in record:
            held_out.append(record["eval/reward_mean"])
        if record.get("step", 0.0) > 0:
            progress.update(record)
        sink.log(record)

    try:
        records = run_vlm_steps(run, on_step, sink.log_samples)
    finally:
        progress.close()
        curve = sink.close()
    if not records:
        sys.stdout.write(f"nothing to do: the run is already at train.steps={config.train.steps}\n")
        return 0
    first, last = records[0], records[-1]
    sys.stdout.write(
        f"{len(records)} steps: reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}"
        + (f", held-out {held_out[0]:.3f} -> {held_out[-1]:.3f}" if len(held_out) > 1 else "")
        + (f"; metrics in {log_dir}" if log_dir else "")
        + (f", curve {curve}" if curve else "")
        + (f"; policy written to {config.checkpoint.save_hf}" if config.checkpoint.save_hf else "")
        + "\n"
    )
    return 0
