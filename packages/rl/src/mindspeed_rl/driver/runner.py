"""The GRPO driver on Ray: worker pools, the replay buffer, sync and async pipelines, checkpoints.

One driver process (this one) starts Ray (or joins ``ray.address``), places the workers in
resource pools (:mod:`mindspeed_rl.workers.pools`) and runs the steps::

    producer:  prompts -> rollout engines -> rewards -> buffer.allocate/put   (policy version v)
    trainer:   buffer.wait_ready -> advantages, old/ref log-probs, update(s)
               -> buffer.advance_version -> weights to the rollout engines     (version v + 1)

Every row goes through the replay buffer (:class:`~mindspeed_rl.buffer.ReplayBuffer`, a Ray
actor). ``buffer.mode=sync``: the producer and the trainer take turns, so the trainer only sees
rows of its current version (on-policy). ``buffer.mode=async``: the producer runs in its own
thread on the separated rollout pool and generates the next batches while the actor trains,
at most ``buffer.max_staleness`` versions ahead (the buffer enforces it; a producer with stale
weights loads the newest before it goes on); the update corrects for the lag with truncated
importance sampling (``algorithm.tis_cap``, default 2 in async mode).

Checkpoints (``checkpoint.save``) hold the actor (weights, optimizer, scheduler, RNG: the LLM
suite's format) plus ``rl_state.json`` (step, policy version, prompt-sampler position), marked
complete last; a run started again with the same recipe continues from the newest complete one
(:mod:`mindspeed.checkpointing`: damaged newer ones are skipped with one warning). A
:class:`~mindspeed.checkpointing.Preemption` passed to :meth:`GRPORunner.run` stops the run
after a step, with a checkpoint, on SIGTERM, Ctrl-C or its time limit.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mindspeed.checkpointing import (
    Preemption,
    StopRequest,
    fault_armed,
    fault_point,
    find_resume,
    holds_checkpoints,
    resolve_schedule,
)
from mindspeed.checkpointing.config import CheckpointConfig
from mindspeed.config import ConfigError
from mindspeed.log import get_logger
from mindspeed.megatron.trusted_load import check_dist_checkpoint
from mindspeed_llm.engine import schedule_settings, scheduler_state
from mindspeed_rl.buffer import BufferClient, create_buffer_actor
from mindspeed_rl.buffer.replay import StalenessError
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.data import load_prompts
from mindspeed_rl.demo import tools_model as _tools_model  # noqa: F401 (registers demo-tools in DEMO_MODELS)
from mindspeed_rl.demo.model import DEMO_MODELS
from mindspeed_rl.demo.model import resolve_model as resolve_demo
from mindspeed_rl.driver.ray_runtime import init_ray
from mindspeed_rl.driver.runner_checkpoints import RL_STATE, RunnerCheckpoints
from mindspeed_rl.driver.trainer import (
    GRPOContext,
    RolloutBatch,
    build_agent,
    collect_rollout,
    eval_due,
    evaluate,
    finish_record,
    prompt_pieces,
    train_on_batch,
)
from mindspeed_rl.models.actor_settings import actor_settings
from mindspeed_rl.rewards import RewardModel
from mindspeed_rl.workers.group import ActorGroup, ColocatedRollout, ReferenceView, RolloutPool
from mindspeed_rl.workers.pools import ResourcePool, local_cpus

logger = get_logger(__name__)

#: Columns of the replay buffer: one per piece of a row of experience.
COLUMNS = (
    "pair",
    "prompt",
    "reference",
    "rollout_logp",
    "loss_mask",
    "reward",
    "parts",
    "batch_metrics",
    "sampler_state",
)
#: Default importance-sampling cap of the asynchronous mode (when ``algorithm.tis_cap`` is unset).
ASYNC_TIS_CAP = 2.0


def resolve_model(config: GRPOConfig) -> str:
    """The actor's model directory (a demo policy, ``demo`` or ``demo-tools``, is built once and cached;
    see :mod:`mindspeed_rl.demo.model`)."""
    model = config.actor.model
    if model in DEMO_MODELS:
        return str(resolve_demo(model))
    return str(model)


def _absolute(value: str | None) -> str | None:
    return None if value is None else str(Path(value).expanduser().absolute())


def absolute_paths(config: GRPOConfig) -> GRPOConfig:
    """The recipe with its file and directory paths made absolute (Ray workers do not share the driver's cwd)."""
    a, d = config.actor, config.data

    def data_path(value: str | None) -> str | None:
        return _absolute(value) if value is not None and Path(value).exists() else value  # keeps demo / demo-test

    return replace(
        config,
        actor=replace(
            a,
            model=_absolute(a.model),
            tokenizer=a.tokenizer if a.tokenizer in (None, "demo") else _absolute(a.tokenizer),
            lora=replace(a.lora, save_peft=_absolute(a.lora.save_peft)),
        ),
        reference=replace(config.reference, model=_absolute(config.reference.model)),
        reward=replace(config.reward, model=_absolute(config.reward.model)),
        data=replace(d, path=data_path(d.path), eval_path=data_path(d.eval_path)),
        logging=replace(config.logging, dir=_absolute(config.logging.dir)),
        checkpoint=replace(
            config.checkpoint, save=_absolute(config.checkpoint.save), save_hf=_absolute(config.checkpoint.save_hf)
        ),
    )


def ray_remote(cls: type) -> Any:
    """``ray.remote(cls)`` (imported late: Ray is started by :func:`~mindspeed_rl.driver.ray_runtime.init_ray`)."""
    import ray

    return ray.remote(cls)


class RemoteScorer:
    """A reward model in a Ray worker, called like a local one (``score_batch``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def score_batch(
        self, prompts: list[str], responses: list[str], references: list[str | None] | None = None
    ) -> list[float]:
        """The worker's scores of ``prompt + response`` for each pair."""
        import ray

        return ray.get(self.handle.score_batch.remote(list(prompts), list(responses), references))

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """The score of one pair."""
        return self.score_batch([prompt], [response], [reference])[0]


def find_run_checkpoint(c: CheckpointConfig) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete run checkpoint in ``c.save`` and its run state (``None``: start at step 1).

    Its files are read the safe way here, in the driver (docs/reliability.md, "Trust"): a file
    whose loading would run code is one line before any worker starts.

    Raises:
        ConfigError: ``c.save`` holds checkpoints but no complete run checkpoint, or a file in
            the newest one is refused.
    """
    if c.save is None or not c.resume or not Path(c.save).is_dir():
        return None
    found = find_resume(c.save)
    if found.path is None or not (found.path / RL_STATE).is_file():
        if holds_checkpoints(c.save):
            why = "; ".join(f"{p.name}: {w}" for p, w in found.skipped) or f"{found.path} has no {RL_STATE}"
            raise ConfigError(
                f"checkpoint.save={c.save!r} holds checkpoints but no complete run checkpoint "
                f"({why}); set checkpoint.resume=false to start from step 1 there or set "
                "checkpoint.save to a new directory"
            )
        return None
    check_dist_checkpoint(found.path)
    return found.path, json.loads((found.path / RL_STATE).read_text(encoding="utf-8"))


class GRPORunner(RunnerCheckpoints):
    """A GRPO run on Ray.

    Args:
        config: the recipe (checked here, before any worker starts).

    Raises:
        ConfigError: the recipe's first problem.
    """

    def __init__(self, config: GRPOConfig) -> None:
        from transformers import AutoTokenizer

        if config.actor.model_type != "llm":
            raise ConfigError(
                f"actor.model_type={config.actor.model_type}: the Ray runner trains text policies; run the recipe "
                "with mindspeed-rl grpo (the launcher's ranks, no Ray: mindspeed_rl.driver.vlm_trainer.train_vlm_grpo)"
            )
        if config.actor.model in DEMO_MODELS:
            config = replace(config, actor=replace(config.actor, model=resolve_model(config)))
        config.check()
        config = absolute_paths(config)
        resume = find_run_checkpoint(config.checkpoint)  # before any worker starts: its errors are one line
        if config.buffer.mode == "async" and config.algorithm.tis_cap is None:
            config = replace(config, algorithm=replace(config.algorithm, tis_cap=ASYNC_TIS_CAP))
            logger.info(
                "async mode: truncated importance sampling against the rollout's log-probs, algorithm.tis_cap=%s",
                ASYNC_TIS_CAP,
            )
        self.config = config
        model_dir = str(config.actor.model)
        r = config.rollout
        workers = config.actor_world_size() + (0 if r.colocate else r.num_devices or 0) + self._more_workers()
        workers += 1 if config.reward.model is not None else 0  # the reward model's worker takes a CPU slot
        init_ray(config.ray.address, num_cpus=local_cpus(workers) if config.ray.address is None else None)
        pinned = config.ray.pool_resources
        self.pools = [ResourcePool("actor", config.actor_world_size(), pinned.get("actor", {})).create()]
        self.group = ActorGroup(config, model_dir, self.pools[0])
        if r.colocate:
            self.rollout: Any = ColocatedRollout(self.group)
        else:
            self.pools.append(ResourcePool("rollout", r.num_devices, pinned.get("rollout", {})).create())
            self.rollout = RolloutPool(config, model_dir, self.pools[1])
        self._start_more_workers(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(config.actor.tokenizer or model_dir)
        self.reward_worker = None
        if config.reward.model is not None:  # scored in its own Ray process, on the host CPU
            self.reward_worker = (
                ray_remote(RewardModel)
                .options(num_cpus=1, resources=pinned.get("reward") or None)
                .remote(config.reward.model, device="cpu", batch_size=config.reward.model_batch_size)
            )
        remote = RemoteScorer(self.reward_worker) if self.reward_worker is not None else None
        records, sampler, fmt, reward = prompt_pieces(config, remote)
        d = config.data
        self.held_out = load_prompts(d.eval_path, d.map_keys or None) if config.train.eval_interval else []
        reference = ReferenceView(self.group) if config.needs_reference() else None
        self.ctx = self._context(config, self.group, self.rollout, tokenizer, reward, records, sampler, fmt, reference)
        # Multi-turn rollouts with rollout.tools: the loop runs in the rollout workers (tool_overlap)
        # or on the driver, one generate call per turn (the barrier).
        self.ctx.agent = build_agent(config, tokenizer)
        # The producer's view: its own step counter (the batch index, which seeds sampling), shared sampler.
        self.pctx = copy.copy(self.ctx)
        self.rows = config.rows_per_step()
        self.buffer_handle = create_buffer_actor(COLUMNS, self.rows, config.buffer.staleness(), config.buffer.mode)

        self.buffer = BufferClient(self.buffer_handle)
        self.version = 0
        self.sampler_state = sampler.state_dict()
        self._latest: tuple[list[Any], int] | None = None
        self._stop = threading.Event()
        self._producer_error: BaseException | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint in checkpoint.save
        self.stopped: StopRequest | None = None  # why the last run() stopped early (a signal, the time limit)
        #: Why the last run() stopped on an error, one line (non-finite updates in a row, a refused save).
        self.failed: str | None = None
        self._maybe_resume(resume)

    def _more_workers(self) -> int:
        """Workers a subclass starts in :meth:`_start_more_workers` (PPO: a separated critic's)."""
        return 0

    def _start_more_workers(self, model_dir: str) -> None:
        """Start a subclass's own pools and workers (after the actor's and the rollout's)."""

    def _context(self, *pieces: Any) -> GRPOContext:
        """The step context of the run (PPO's adds the critic and the KL controller)."""
        return GRPOContext(*pieces)

    def _train_on_batch(self, batch: RolloutBatch) -> dict[str, float]:
        """Advantages and updates on one batch (PPO's adds values, GAE and the critic)."""
        return train_on_batch(self.ctx, batch)

    # -- producing ---------------------------------------------------------------------------

    def _push_weights(self) -> float:
        """Weights of the actor's current version to the rollout engines (co-located: in place)."""
        start = time.perf_counter()
        if self.config.rollout.colocate:
            self.rollout.sync(self.version)
        else:
            self._latest = (self.group.call("export_weights")[0], self.version)
            if self.config.buffer.mode == "sync":
                self.rollout.load_weights(*self._latest)
        return time.perf_counter() - start

    def produce(self, pctx: GRPOContext, version: int) -> float:
        """Generate and score one batch with weights of ``version`` and write it to the buffer; seconds taken."""
        start = time.perf_counter()
        rows = self.buffer.allocate(self.rows, version)
        batch = collect_rollout(pctx)
        after = pctx.sampler.state_dict()
        n = len(batch.pairs)
        if n != self.rows:
            raise RuntimeError(
                f"the rollout returned {n} rows for a step of {self.rows}: every prompt of a step must "
                "fit rollout.max_prompt_length (raise it)"
            )
        put = self.buffer.put
        put("pair", rows, batch.pairs)
        put("prompt", rows, batch.prompts)
        put("reference", rows, batch.references)
        put("rollout_logp", rows, batch.rollout_logp)
        put("loss_mask", rows, batch.loss_masks if batch.loss_masks is not None else [None] * n)
        put("parts", rows, [{k: float(v[i]) for k, v in batch.parts.items()} for i in range(n)])
        put("batch_metrics", rows, [dict(batch.metrics, **{"time/rollout": time.perf_counter() - start})] * n)
        put("sampler_state", rows, [after] * n)
        put("reward", rows, [float(x) for x in batch.rewards])  # last: makes the rows ready
        pctx.step += 1
        return time.perf_counter() - start

    def _producer_loop(self, pctx: GRPOContext, count: int) -> None:
        loaded = self.version
        try:
            for _ in range(count):
                while not self._stop.is_set():
                    latest = self._latest
                    if latest is not None and latest[1] > loaded:
                        self.rollout.load_weights(*latest)
                        loaded = latest[1]
                    try:
                        self.produce(pctx, loaded)
                        break
                    except StalenessError:  # the trainer moved on: take its newer weights first
                        while not self._stop.is_set() and (self._latest is None or self._latest[1] <= loaded):
                            time.sleep(0.01)
                if self._stop.is_set():
                    return
        except BaseException as err:  # surfaced by the trainer's loop
            self._producer_error = err
            self.buffer.close()

    # -- training ----------------------------------------------------------------------------

    def consume(self) -> tuple[RolloutBatch, list[int], dict[str, Any]]:
        """The oldest full batch of ready rows (blocks until there is one)."""
        rows = self.buffer.wait_ready(list(COLUMNS), self.rows, "trainer")
        got = self.buffer.get(list(COLUMNS) + ["version"], rows)
        parts = {k: torch.tensor([p[k] for p in got["parts"]]) for k in got["parts"][0]}
        batch = RolloutBatch(
            [tuple(p) for p in got["pair"]],
            got["prompt"],
            got["reference"],
            got["rollout_logp"],
            torch.tensor(got["reward"], dtype=torch.float32),
            parts,
            {k: v for k, v in got["batch_metrics"][0].items() if k != "time/rollout"},
            None if got["loss_mask"][0] is None else got["loss_mask"],
        )
        lag = [self.version - v for v in got["version"]]
        info = {
            "sampler_state": got["sampler_state"][-1],
            "time/rollout": got["batch_metrics"][0]["time/rollout"],
            "staleness_mean": sum(lag) / len(lag),
            "staleness_max": float(max(lag)),
        }
        return batch, rows, info

    def train_step(self, wait_start: float) -> dict[str, float]:
        """Take one batch from the buffer, update the actor, advance the version, push the weights."""
        mark = time.perf_counter()
        batch, rows, info = self.consume()
        waited = time.perf_counter() - mark
        record = self._train_on_batch(batch)
        self.buffer.mark_consumed(rows)
        self.version += 1
        self.buffer.advance_version(self.version)
        self.sampler_state = info.pop("sampler_state")
        record.update(info)
        record["time/wait_rollout"] = waited
        record["time/weight_sync"] = self._push_weights()
        record.update(self._phase_stats())
        if not self.config.rollout.colocate:
            record.update(self.rollout.phase_stats())
        record = finish_record(self.ctx, batch, record, time.perf_counter() - wait_start)
        record["policy_version"] = float(self.version)
        return record

    def step(self) -> dict[str, float]:
        """One synchronous step: produce a batch with the current weights, then train on it."""
        start = time.perf_counter()
        self.produce(self.pctx, self.version)
        return self.train_step(start)

    def run(
        self, steps: int | None = None, on_step: Any = None, preemption: Preemption | None = None
    ) -> list[dict[str, float]]:
        """Run until ``train.steps`` (or ``steps`` more); saves checkpoints as the recipe says.

        Args:
            steps: steps to run now (default: the rest of ``train.steps``).
            on_step: called with each step's record.
            preemption: asked after every step; when it requests a stop, the run saves (unless
                this step is saved) and returns, with :attr:`stopped` set.

        Returns:
            The records of the steps run.
        """
        total = self.config.train.steps
        count = min(steps if steps is not None else total, total - self.ctx.step)
        records = []
        producer = None
        if self.held_out and self.ctx.step == 0 and count > 0:  # the starting policy, as step 0
            start_eval = {"step": 0.0, **evaluate(self.ctx, self.held_out)}
            if on_step is not None:
                on_step(start_eval)
        if self.config.buffer.mode == "async" and count > 0:
            producer = threading.Thread(
                target=self._producer_loop, args=(self.pctx, count), name="rollout-producer", daemon=True
            )
            producer.start()
        try:
            for _ in range(count):
                start = time.perf_counter()
                if producer is None:
                    record = self.step()
                else:
                    try:
                        record = self.train_step(start)
                    except Exception:
                        if self._producer_error is not None:
                            raise self._producer_error from None
                        raise
                if self.held_out and eval_due(self.ctx.step, self.config.train):
                    record.update(evaluate(self.ctx, self.held_out))  # the engine's weights of this moment
                records.append(record)
                if on_step is not None:
                    on_step(record)
                fault_point("rl.step_end", self.ctx.step)
                self._kill_on_fault(self.ctx.step)
                if self._diverged(record) or not self._maybe_save():
                    break
                if preemption is not None and (stop := preemption.requested()) is not None:
                    self.stopped = stop
                    if self.config.checkpoint.save is not None and self.saved_step != self.ctx.step:
                        self._save_or_fail(self.config.checkpoint.save)
                    break
        finally:
            self._stop.set()
            if producer is not None:
                self.buffer.close()
                producer.join(timeout=60)
        return records

    def _kill_on_fault(self, step: int) -> None:
        """The fault points ``rl.kill_actor`` / ``rl.kill_buffer``: SIGKILL that worker's process, as ``kill -9`` would."""
        for name, handle in (("rl.kill_actor", self.group.workers[0]), ("rl.kill_buffer", self.buffer_handle)):
            if fault_armed(name, step):
                import ray

                os.kill(ray.get(handle.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)

    def _phase_stats(self) -> dict[str, float]:
        """The trainer workers' timings and memory of the step (the maximum over the workers)."""
        return self.group.phase_stats()

    def _trainer_workers(self) -> list[Any]:
        """The Ray actors that train (the actor group's; PPO adds a separated critic's)."""
        return list(self.group.workers)

    def worker_roles(self) -> dict[str, str]:
        """Ray actor id (hex) -> what that worker is to this run (``actor worker rank 0 of 2``)."""
        roles = {}
        world = len(self.group.workers)
        for i, worker in enumerate(self._trainer_workers()):
            role = "actor" if i < world else "critic"
            roles[worker._actor_id.hex()] = f"{role} worker rank {i % world} of {world}"
        rollout = getattr(self.rollout, "workers", [])
        for i, worker in enumerate(rollout):
            roles[worker._actor_id.hex()] = f"rollout worker rank {i} of {len(rollout)}"
        roles[self.buffer_handle._actor_id.hex()] = "replay buffer"
        if self.reward_worker is not None:
            roles[self.reward_worker._actor_id.hex()] = "reward model worker"
        return roles

    # -- checkpoints -------------------------------------------------------------------------

    def _maybe_resume(self, resume: tuple[Path, dict[str, Any]] | None) -> None:
        if resume is None:
            return
        path, state = resume
        flags = check_actor_schedule(self.config, path, int(state["step"]))
        self._load_actor(path, flags, int(state["step"]))
        self.ctx.step = self.pctx.step = int(state["step"])
        self.saved_step = self.ctx.step
        self.version = int(state["version"])
        self.sampler_state = state["sampler"]
        self.ctx.sampler.load_state_dict(state["sampler"])
        self.buffer.advance_version(self.version)
        self._push_weights()
        if not self.config.rollout.colocate and self.config.buffer.mode == "async":
            self.rollout.load_weights(*self._latest)  # the producer starts from the resumed version
        logger.info("resumed from %s (step %d)", path, self.ctx.step)

    def _load_actor(self, path: Path, flags: tuple[bool, bool], step: int) -> None:
        """The actor workers load ``path`` (PPO: without the optimizer while the critic warms up)."""
        self.group.call("load", str(path), *flags)

    def shutdown(self) -> None:
        """Stop the workers and give the pools back (Ray itself keeps running)."""
        import ray

        self._stop.set()
        for worker in self._trainer_workers():
            ray.kill(worker)
        for worker in getattr(self.rollout, "workers", []):
            ray.kill(worker, no_restart=True)
        ray.kill(self.buffer_handle)
        if self.reward_worker is not None:
            ray.kill(self.reward_worker)
        for pool in self.pools:
            pool.remove()


def check_actor_schedule(config: GRPOConfig, path: Path, step: int) -> tuple[bool, bool]:
    """Check the actor's learning-rate schedule against checkpoint ``path``'s before the workers load it.

    Returns:
        ``(checkpoint.override_scheduler, checkpoint.use_checkpoint_scheduler)`` for the workers' load.

    Raises:
        ConfigError: the schedules differ and neither flag says which wins (one line listing each difference).
    """
    c = config.checkpoint
    try:  # the scheduler's state is plain data: no code runs while it is read
        saved = torch.load(path / "common.pt", map_location="cpu", weights_only=True).get("opt_param_scheduler")
    except Exception:  # an unreadable common state: the workers' load says what is wrong with it
        saved = None
    if isinstance(saved, dict) and "max_lr" in saved:
        sched = actor_settings(config).scheduler
        decay = "the decay length (train.steps x updates per step)"
        resolve_schedule(
            schedule_settings(saved, prefix="actor.", decay_key=decay),
            schedule_settings(scheduler_state(sched, sched.lr_warmup_steps + 1), prefix="actor.", decay_key=decay),
            path,
            step,
            override=c.override_scheduler,
            use_checkpoint=c.use_checkpoint_scheduler,
        )
    return c.override_scheduler, c.use_checkpoint_scheduler
