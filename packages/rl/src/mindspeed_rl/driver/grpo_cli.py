"""``mindspeed-rl grpo --config recipe.yaml [--print-config] [key=value ...]``: a GRPO (or DAPO) run on Ray.

The recipe (:class:`~mindspeed_rl.config.grpo.GRPOConfig`) is read, overridden and checked before
any worker starts; a bad key or value exits 2 with the key and the fix. The run logs one line
(or a progress bar on a terminal) per step, writes ``metrics.jsonl``, TensorBoard events and
``reward.png`` to ``logging.dir`` (default ``checkpoint.save``), saves checkpoints to
``checkpoint.save`` and continues from the newest complete one when started again, and writes
the final policy as a Hugging Face directory to ``checkpoint.save_hf``. SIGTERM, the first
Ctrl-C and ``train.exit_duration_mins`` finish the step, save and exit 143 / 130 / 0 with one
line naming the checkpoint (see docs/reliability.md). A Ray worker of the run that dies (the
actor, the replay buffer, the reward model; a rollout worker that keeps dying after its restarts)
ends the run with one line naming it, Ray's exit cause, the newest complete checkpoint and that
the same command resumes from it, exit 1 (:data:`WORKER_DIED`); Ray's traceback goes to the run's
report.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING, Any

import yaml

from mindspeed.checkpointing import Preemption, resume_hint, run_lock
from mindspeed.config import ConfigError, to_dict
from mindspeed.log import DETAIL, RUN_LOG_FILE, get_logger, open_run_log, run_log_path
from mindspeed.nodes import add_launch_arguments, nodes_from_args
from mindspeed_rl.workers.deaths import describe_death, find_actor_error

if TYPE_CHECKING:
    from mindspeed_rl.driver.runner import GRPORunner

logger = get_logger(__name__)

#: Exit status of a run ended by the death of one of its Ray workers.
WORKER_DIED = 1


def add_grpo(sub: argparse._SubParsersAction) -> None:
    """Add ``grpo`` to the ``mindspeed-rl`` subcommands."""
    parser = sub.add_parser(
        "grpo",
        help="train a policy with GRPO / DAPO on Ray",
        description="GRPO on Ray: actor (megatron-core), reference, rollout engines and rewards "
        "in resource pools, co-located or separated, sync or async through the "
        "replay buffer. Recipe keys: see docs/rl/ and examples/rl/.",
    )
    parser.add_argument("--config", help="the recipe (YAML)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML and exit")
    # actor.model_type=vlm runs as torchrun-style ranks (Ulysses SP); a text run places its workers with Ray.
    add_launch_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. rollout.n=4")
    parser.set_defaults(func=run_grpo)


def run_grpo(args: argparse.Namespace) -> int:
    """Run the recipe; returns the exit status."""
    # Lazy: keeps torch out of the start-up of mindspeed_rl.cli.
    from mindspeed_rl.config.grpo import load_grpo_config

    try:
        config = load_grpo_config(args.config, args.overrides)
    except ConfigError as err:
        raise ValueError(str(err)) from err
    if args.print_config:  # before any check, model or worker: what the recipe and the overrides say
        sys.stdout.write(yaml.safe_dump(to_dict(config), sort_keys=False))
        return 0
    if config.actor.model_type == "vlm":  # a vision-language policy: one process (docs/rl/vlm.md)
        from mindspeed_rl.driver.vlm_cli import run_vlm_grpo

        try:
            return run_vlm_grpo(config, nodes_from_args(args), args.nproc_per_node)
        except ConfigError as err:
            raise ValueError(str(err)) from err
    if args.nproc_per_node != 1 or args.nnodes != 1:
        raise ValueError(
            "--nproc-per-node / --nnodes start the ranks of an actor.model_type=vlm run; a text run places its "
            "workers with Ray (actor.tp / pp / dp, ray.*): drop them"
        )
    # One run per save directory: the driver holds its lock from before the resume to the end.
    with run_lock(config.checkpoint.save):
        return _run_grpo(config)


def _run_grpo(config: Any, runner_class: Any = None, stage: str = "grpo") -> int:
    """Run a checked-or-not recipe with ``runner_class`` (default :class:`GRPORunner`; ``ppo``: PPORunner)."""
    from mindspeed_rl.driver.metrics import ProgressLine, RLMetricsLog, per_device
    from mindspeed_rl.driver.runner import GRPORunner

    try:
        runner = (runner_class or GRPORunner)(config)
    except ConfigError as err:
        raise ValueError(str(err)) from err
    config = runner.config
    devices = config.actor_world_size() + (0 if config.rollout.colocate else config.rollout.num_devices or 0)
    log_dir = config.log_dir()
    # logging.trackers (metrics.jsonl, TensorBoard, wandb, ...) with the resolved recipe as the run's config.
    sink = RLMetricsLog(
        log_dir,
        reward_curve=config.logging.reward_curve,
        resume_step=runner.ctx.step,
        settings=config.logging,
        config=to_dict(config),
    )
    progress = ProgressLine(
        config.train.steps,
        bar=config.logging.progress,
        interval=config.logging.interval,
        stage=stage,
        start=runner.ctx.step,
    )

    held_out: list[float] = []  # eval/reward_mean of each evaluation, the starting policy's first

    def on_step(record: dict[str, float]) -> None:
        if "eval/reward_mean" in record:
            held_out.append(record["eval/reward_mean"])
        record = per_device(record, devices)
        progress.update(record)
        sink.log(record)
        if "eval/reward_mean" in record:  # this step evaluated: its held-out responses as a table
            sink.log_samples(int(record["step"]), runner.ctx.eval_samples)

    # The driver's full log (detail and other libraries' warnings included) goes to logging.dir/report.txt.
    with open_run_log(log_dir / RUN_LOG_FILE) if log_dir is not None else contextlib.nullcontext():
        try:
            with Preemption(config.train.exit_duration_mins, config.checkpoint.save) as preemption:
                records = runner.run(on_step=on_step, preemption=preemption)
            if runner.failed is not None:  # non-finite updates in a row, or a save refused for NaN/Inf
                logger.error("%s stopped early: %s", stage, runner.failed)
                return 1
            stop = runner.stopped
            if stop is not None:
                where = runner.checkpoint_path()
                cause = (
                    f"the time limit (train.exit_duration_mins={config.train.exit_duration_mins})"
                    if stop.reason == "time limit"
                    else stop.reason
                )
                logger.warning(
                    "stopped by %s after step %d of %d: %s",
                    cause,
                    runner.ctx.step,
                    config.train.steps,
                    resume_hint(str(where) if where is not None else None),
                )
                return stop.exit_code
            if config.checkpoint.save_hf:
                path = runner.save_hf(config.checkpoint.save_hf)
                sys.stdout.write(f"policy written to {path}\n")
            if config.actor.lora.save_peft:
                path = runner.save_peft(config.actor.lora.save_peft)
                sys.stdout.write(f"LoRA adapter (PEFT) written to {path}\n")
        except Exception as err:
            dead = find_actor_error(err)
            if dead is None:
                raise
            report_worker_death(runner, dead, err)
            return WORKER_DIED
        finally:
            progress.close()
            curve = sink.close()
            runner.shutdown()
    if records:
        first, last = records[0], records[-1]
        sys.stdout.write(
            f"{len(records)} steps: reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}"
            + (f", held-out {held_out[0]:.3f} -> {held_out[-1]:.3f}" if len(held_out) > 1 else "")
            + (f"; metrics in {log_dir}" if log_dir else "")
            + (f", curve {curve}" if curve else "")
            + "\n"
        )
    else:
        sys.stdout.write(f"nothing to do: the run is already at train.steps={config.train.steps}\n")
    return 0


def report_worker_death(runner: GRPORunner, dead: BaseException, err: BaseException) -> None:
    """One line for a run ended by a dead Ray worker; Ray's traceback goes to the run's report file only."""
    # A warning marked as detail: the report file keeps it at --log-level WARNING too; the console does not show it.
    logger.warning("a Ray worker of the run died; Ray's traceback:", exc_info=err, extra=DETAIL)
    newest = runner.newest_checkpoint()
    config = runner.config
    report = run_log_path()
    logger.error(
        "%s; the run stopped after step %d of %d: %s%s",
        describe_death(dead, runner.worker_roles()),
        runner.ctx.step,
        config.train.steps,
        resume_hint(str(newest) if newest is not None else None)
        if newest is not None or config.checkpoint.save is None
        else f"no complete checkpoint in {config.checkpoint.save} yet; the same command starts again from step 1",
        f" (Ray's traceback: {report})" if report is not None else "",
    )
