"""The actor worker: one rank of the policy's torch.distributed group, in its own Ray process.

Every worker holds its shard of the trainable policy (megatron-core, any TP/PP/DP layout), the
frozen reference's shard when the recipe has a KL penalty (co-located: same device), and, in
co-located mode, a rollout engine on the first rank of each data-parallel replica. Methods that
touch the model are collective: the driver calls them on every worker at once
(:class:`~mindspeed_rl.workers.group.ActorGroup`).

Co-location: while the engine generates, the actor's optimizer state and gradients are moved
to host memory (``actor.offload_optimizer`` / ``offload_grad``) and brought back afterwards;
the time and the memory of each phase are recorded in :meth:`ActorWorker.phase_stats`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mindspeed.checkpointing.hf_dtype import target_dtype
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_llm.engine import load_model_checkpoint, save_model_checkpoint
from mindspeed_rl.models.actor import Actor
from mindspeed_rl.models.actor_settings import actor_settings, build_critic, build_reference
from mindspeed_rl.models.memory import freeze_startup_objects, memory_gib
from mindspeed_rl.workers.hf_export import write_hf_dir
from mindspeed_rl.workers.rollout_worker import build_engine

logger = get_logger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class ActorWorker:
    """One rank of the actor group (wrapped by ``ray.remote`` when the pool starts it).

    Args:
        rank: the global rank in the actor group. world_size: the group's size.
        config: the GRPO recipe (:class:`~mindspeed_rl.config.grpo.GRPOConfig`).
        model_dir: the resolved actor model directory.
        role: ``actor`` (the policy, its reference, a co-located critic and engine) or ``critic``
            (PPO's ``critic.colocate: false``: only the critic, in its own pool and process group).
    """

    def __init__(self, rank: int, world_size: int, config: Any, model_dir: str, role: str = "actor") -> None:
        self.rank, self.world_size, self.config, self.model_dir = rank, world_size, config, model_dir
        self.role = role
        self.actor: Any = None
        self.reference: Any = None
        self.critic: Any = None  # PPO: the critic's shard, co-located with the actor's
        self.engine: Any = None
        self.stats: dict[str, float] = {}

    def address(self) -> tuple[str, int]:
        """A host and free port for the group's rendezvous (asked of rank 0)."""
        return socket.gethostbyname(socket.gethostname()), _free_port()

    def setup(self, host: str, port: int) -> dict[str, int]:
        """Join the process group and build the actor, the reference, a co-located critic and engine
        (a ``critic`` worker: only the critic) (collective).

        Returns:
            This rank's place: ``rank``, ``dp_rank``, ``tp_rank``, ``pp_rank``, ``engine`` (1 if it
            holds a rollout engine).
        """
        import torch.distributed as dist

        cfg = self.config
        acc = get_accelerator()
        if acc.ray_resource:  # Ray made one device visible to this process: it is index 0
            acc.set_device(0)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        if not dist.is_initialized():
            dist.init_process_group(
                acc.dist_backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size
            )
        a = cfg.actor
        critic = getattr(cfg, "critic", None)
        if self.role == "critic":
            self.critic = build_critic(cfg, self.model_dir)
            return self._place(self.critic.groups, engine=False)
        settings = actor_settings(cfg)
        self.actor = Actor(self.model_dir, settings, tp=a.tp, pp=a.pp, features=cfg.features)
        self.reference = build_reference(cfg, self.actor, self.model_dir)
        if critic is not None and critic.colocate:
            self.critic = build_critic(cfg, self.model_dir)
        groups = self.actor.groups
        holds = cfg.rollout.colocate and groups.tp.rank() == 0 and groups.pp.rank() == 0
        if holds:
            self.engine = build_engine(cfg, self.model_dir)
        return self._place(groups, engine=holds)

    def _place(self, groups: Any, engine: bool) -> dict[str, int]:
        freeze_startup_objects()
        return {
            "rank": self.rank,
            "dp_rank": groups.dp.rank(),
            "tp_rank": groups.tp.rank(),
            "pp_rank": groups.pp.rank(),
            "engine": int(engine),
        }

    # -- training ----------------------------------------------------------------------------

    def compute_logprobs(
        self, pairs: Sequence[tuple[list[int], list[int]]], reference: bool = False
    ) -> list[torch.Tensor]:
        """This data-parallel rank's log-probs of ``pairs`` (collective; see ``Actor.compute_logprobs``)."""
        model = self.reference if reference else self.actor
        if model is None:
            raise ValueError("this run has no reference model (the KL coefficient is 0)")
        start = time.perf_counter()
        out = model.compute_logprobs(pairs)
        if reference and self.config.reference.offload:
            # Co-location: the frozen weights wait in host memory until the next step needs them.
            moved = model.offload(optimizer=False, grad=False, weights=True)
            self.stats["memory/reference_offloaded_gib"] = sum(moved.values()) / 2**30
        self.stats["time/" + ("ref_logp" if reference else "old_logp") + "_worker"] = time.perf_counter() - start
        return out

    def update(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None,
        rollout_logp: torch.Tensor | None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (collective)."""
        metrics = self.actor.update(pairs, old_logp, advantages, ref_logp, rollout_logp, loss_mask)
        self.stats.update({f"memory/update_{k}": v for k, v in memory_gib().items()})
        return metrics

    def compute_values(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """This data-parallel rank's critic values of ``pairs`` (collective; see ``Critic.compute_values``)."""
        start = time.perf_counter()
        out = self._critic().compute_values(pairs)
        self.stats["time/values_worker"] = time.perf_counter() - start
        return out

    def update_critic(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        values: torch.Tensor,
        returns: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One critic step on this rank's share of a mini-batch (collective)."""
        return self._critic().update(pairs, values, returns, loss_mask)

    def _critic(self) -> Any:
        if self.critic is None:
            raise ValueError("this run has no critic (mindspeed-rl grpo); PPO's critic comes with mindspeed-rl ppo")
        return self.critic

    def version(self) -> int:
        """Updates the actor (a critic worker: the critic) has taken."""
        return int((self.actor or self.critic).version)

    # -- rollout (co-located) --------------------------------------------------------------

    def _offload(self) -> None:
        r, a = self.config.rollout, self.config.actor
        offload = getattr(self.actor, "offload", None)
        if r.colocate and offload is not None and (a.offload_optimizer or a.offload_grad):
            offload(optimizer=a.offload_optimizer, grad=a.offload_grad)
        if r.colocate and self.critic is not None and (a.offload_optimizer or a.offload_grad):
            # The critic is not used while the engine generates: its weights leave the device too
            # (compute_values brings them back, update the rest).
            self.critic.offload(optimizer=a.offload_optimizer, grad=a.offload_grad, weights=True)

    def _onload(self) -> None:
        onload = getattr(self.actor, "onload", None)
        if onload is not None:
            onload()

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """Generate with the co-located engine (the actor's training state offloaded meanwhile)."""
        return self._with_engine(lambda engine: engine.generate(list(prompts), list(params)))

    def agent_generate(
        self, agent: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], conversations: Sequence[Any]
    ) -> list[Any]:
        """Multi-turn rollouts of the driver's agent loop on the co-located engine, the tools run here
        (overlapped with the generation on the built-in engine; see ``AgentLoop.run``)."""
        return self._with_engine(lambda engine: agent.run(engine, list(prompts), list(params), list(conversations)))

    def _with_engine(self, work: Any) -> list[Any]:
        if self.engine is None:
            raise ValueError(f"actor rank {self.rank} holds no rollout engine")
        start = time.perf_counter()
        self._offload()
        self.stats["time/offload"] = time.perf_counter() - start
        self.stats["memory/actor_offloaded_gib"] = self.actor.memory()["offloaded_bytes"] / 2**30
        try:
            outputs = work(self.engine)
            self.stats.update({f"memory/rollout_{k}": v for k, v in memory_gib().items()})
        finally:
            self.engine.sleep()  # the KV cache (vLLM: also the weights) leaves the device for the update
            mark = time.perf_counter()
            self._onload()
            self.stats["time/onload"] = time.perf_counter() - mark
        return outputs

    def sync_weights(self) -> float:
        """Load the actor's current weights into the co-located engine (collective: ``hf_state`` gathers)."""
        start = time.perf_counter()
        state = self.actor.hf_state()
        if self.engine is not None:
            self.engine.load_weights(state)
        return time.perf_counter() - start

    def export_weights(self) -> list[Any]:
        """The actor's weights for a separated rollout pool (collective); rank 0 returns ``[ObjectRef]``.

        The state goes into Ray's object store once, from here; rollout workers read it from
        there, so the driver never holds the weights.
        """
        import ray

        state = self.actor.hf_state()
        if self.rank != 0:
            return []
        return [ray.put({k: v.detach().cpu() for k, v in state.items()})]

    def phase_stats(self) -> dict[str, float]:
        """Timings and memory of the last phases this worker ran."""
        return dict(self.stats)

    # -- checkpoints -------------------------------------------------------------------------

    def save(
        self, root: str, step: int, extra_files: dict[str, str] | None = None, keep_last: int | None = None
    ) -> str:
        """Save the actor (weights, optimizer, scheduler, RNG) as ``root/iter_<step>`` (collective).

        ``extra_files`` (the driver's run state) are written into the checkpoint before it is
        marked complete; ``keep_last`` rotates complete checkpoints. A LoRA actor saves its adapters
        only (``Actor.save_checkpoint``); a resume rebuilds the base from ``actor.model``.
        """
        return str(self.actor.save_checkpoint(root, step, extra_files=extra_files, keep_last=keep_last))

    def load(
        self,
        path: str,
        override_scheduler: bool = False,
        use_checkpoint_scheduler: bool = False,
        load_optimizer: bool = True,
    ) -> int:
        """Restore a checkpoint written by :meth:`save` (collective); returns its step.

        The flags say whose learning-rate schedule wins when the checkpoint's differs from the actor's
        (the driver has checked that one of them is set then: ``runner.check_actor_schedule``).
        ``load_optimizer`` false: the weights only (an actor that has not updated yet, as in PPO's
        critic warmup, saved an optimizer without state: the fresh one is the same).
        """
        step = load_model_checkpoint(
            Path(path),
            self.actor,
            override_scheduler=override_scheduler,
            use_checkpoint_scheduler=use_checkpoint_scheduler,
            load_optimizer=load_optimizer,
        )
        self.actor.version = step
        return step

    def save_critic(self, root: str, step: int, keep_last: int | None = None) -> str:
        """Save the critic (weights, optimizer, scheduler) as ``root/iter_<step>`` (collective)."""
        c = self._critic()
        c.onload()  # the critic stays offloaded after a rollout (an evaluation's) until it is used
        return str(save_model_checkpoint(root, step, c, keep_last=keep_last))

    def load_critic(self, path: str) -> int:
        """Restore the critic from :meth:`save_critic`'s ``path`` (collective); returns its step."""
        c = self._critic()
        c.onload()
        c.version = load_model_checkpoint(Path(path), c)
        return c.version

    def save_hf(self, target: str) -> str | None:
        """Write the policy as a Hugging Face directory (collective gather; rank 0 writes)."""
        state = self.actor.hf_state()
        if self.rank != 0:
            return None
        return str(write_hf_dir(state, self.model_dir, target, target_dtype(self.config.checkpoint.save_hf_dtype)))

    def save_peft(self, target: str) -> None:
        """Write the LoRA actor's adapter as a PEFT adapter directory (collective gather; rank 0 writes)."""
        self.actor.export_peft(target)

    def shutdown(self) -> None:
        """Undo the actor's adaptation of megatron-core and leave the process group."""
        import torch.distributed as dist

        if self.critic is not None:
            self.critic.close()
        if self.actor is not None:
            self.actor.close()
        if dist.is_initialized():
            dist.destroy_process_group()
