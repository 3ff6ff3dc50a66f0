"""``mindspeed-rl grpo`` for a vision-language recipe (``actor.model_type: vlm``): the launcher's ranks, no Ray.

The run holds ``checkpoint.save``'s run lock and runs as the ranks the core's launcher starts
(:func:`mindspeed.launch.launch`: ``--nproc-per-node``, torchrun's flags): ``actor.dp`` data-parallel
replicas of a Ulysses group of ``actor.ulysses_parallel_size`` consecutive ranks (the multimodal
trainer's ``(dp, sp)`` mesh). Each replica generates and scores its share of the step's requests,
the results are gathered, and each trains on its share of every mini-batch; the ranks of a Ulysses
group run their shares of every packed microbatch; rank 0 writes the metrics. It resumes
from the newest complete checkpoint in ``checkpoint.save`` (the same command continues a stopped
run), saves every ``checkpoint.interval`` steps and after the last, and writes the policy to
``checkpoint.save_hf`` at the end (:mod:`mindspeed_rl.driver.vlm_checkpoint`).

The metrics go where a text run writes them (``logging.dir``: ``metrics.jsonl``, TensorBoard,
``reward.png``, the held-out answers as a table; a resumed run drops the records after its
checkpoint's step), one line a step on the console, and the summary line
``N steps: reward a -> b, held-out c -> d``. SIGTERM, the first Ctrl-C and ``train.exit_duration_mins``
stop the run after the step under way, saved first (exit 143 / 130 / 0, one line naming the
checkpoint), as ``mindspeed-mm train`` and the text driver do.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from mindspeed.checkpointing import Preemption, resume_hint, run_lock
from mindspeed.config import to_dict
from mindspeed.launch import launch
from mindspeed.log import get_logger
from mindspeed.nodes import Nodes
from mindspeed_mm.trainer.checkpoint import step_dir
from mindspeed_mm.trainer.fsdp import build_sp_mesh
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.driver.metrics import ProgressLine, RLMetricsLog
from mindspeed_rl.driver.vlm_trainer import run_vlm_steps, start_vlm_run

logger = get_logger(__name__)


def run_vlm_grpo(config: GRPOConfig, nodes: Nodes | None = None, nproc_per_node: int = 1) -> int:
    """Run a vision-language recipe on ``nproc_per_node`` ranks (x ``nodes``); returns the exit status (0).

    Raises:
        ValueError: the ranks are not ``actor.dp`` x ``actor.ulysses_parallel_size``.
    """
    nodes = nodes or Nodes()
    world = nodes.world_size(nproc_per_node)
    dp, sp = config.actor.dp, config.actor.ulysses_parallel_size
    if world != dp * sp:
        raise ValueError(
            f"{world} ranks and actor.dp={dp} x actor.ulysses_parallel_size={sp} = {dp * sp}: start "
            f"{dp * sp} ranks (--nproc-per-node {dp * sp}) or set actor.dp={max(world // sp, 1)}"
        )
    with run_lock(config.checkpoint.save, node_rank=nodes.node_rank):
        result = launch(_vlm_rank, (config,), nproc_per_node=nproc_per_node, nodes=nodes)
    return int(result or 0)


def vlm_groups(dp: int, sp: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's ``(Ulysses group, data-parallel group)`` of the ``(dp, sp)`` mesh (None for a size of 1)."""
    if dp * sp == 1:
        return None, None
    mesh = build_sp_mesh(dp * sp, sp)
    return (mesh["sp"].get_group() if sp > 1 else None), (mesh["dp"].get_group() if dp > 1 else None)


def _vlm_rank(config: GRPOConfig) -> int:
    """The run on this rank: build and resume, step (rank 0 writes the metrics and the summary line)."""
    run = start_vlm_run(config, *vlm_groups(config.actor.dp, config.actor.ulysses_parallel_size))
    config = run.ctx.config
    rank0 = dist.get_rank() == 0
    log_dir = config.log_dir()
    sink = RLMetricsLog(
        log_dir,
        reward_curve=config.logging.reward_curve,
        resume_step=run.ctx.step,
        settings=config.logging,
        config=to_dict(config),
        enabled=rank0,
    )
    progress = ProgressLine(
        config.train.steps,
        bar=config.logging.progress and rank0,
        interval=config.logging.interval if rank0 else 10**9,
        start=run.ctx.step,
    )
    held_out: list[float] = []

    def on_step(record: dict[str, float]) -> None:
        if "eval/reward_mean" in record:
            held_out.append(record["eval/reward_mean"])
        if record.get("step", 0.0) > 0:
            progress.update(record)
        sink.log(record)

    try:
        with Preemption(config.train.exit_duration_mins, config.checkpoint.save) as preemption:
            records = run_vlm_steps(run, on_step, sink.log_samples, preemption)
    finally:
        progress.close()
        curve = sink.close()
    if run.stopped is not None:
        save = config.checkpoint.save
        if rank0:
            logger.warning(
                "stopped by %s after step %d of %d: %s",
                run.stopped.reason,
                run.ctx.step,
                config.train.steps,
                resume_hint(str(step_dir(save, run.ctx.step)) if save else None),
            )
        return run.stopped.exit_code
    if not rank0:
        return 0
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
