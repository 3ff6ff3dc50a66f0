"""Driver-side handles of the worker groups, with the single-process APIs the GRPO step uses.

:class:`ActorGroup` looks like an :class:`~mindspeed_rl.models.actor.Actor` (``compute_logprobs``,
``update``, ``version``) but runs every call on all ranks of the actor group at once, each
data-parallel replica on its share of the sequences: the shares are balanced by token count
(:func:`~mindspeed_rl.buffer.balance.balanced_partitions`, MindSpeed-RL's load balancing of
variable-length sequences), and the results are put back in the caller's order.

:class:`RolloutPool` and :class:`ColocatedRollout` look like an inference engine (``generate``):
the prompts are cut into contiguous shares, one per engine. Every request carries its own seed,
so what is generated does not depend on how the prompts were cut or on which engine ran them.
A rollout worker that dies is started again by Ray; the pool waits for it, pushes the current
weights and runs the generation again (same seeds: the same responses).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_rl.buffer.balance import balanced_partitions
from mindspeed_rl.workers.actor_worker import ActorWorker
from mindspeed_rl.workers.pools import ResourcePool
from mindspeed_rl.workers.rollout_worker import RolloutWorker

logger = get_logger(__name__)

Pair = tuple[list[int], list[int]]


def _shares(count: int, parts: int) -> list[range]:
    step = -(-count // parts)
    return [range(min(i * step, count), min((i + 1) * step, count)) for i in range(parts)]


class ActorGroup:
    """The actor's Ray workers (one per device of ``pool``), driven as one actor.

    Args:
        config: the GRPO recipe. model_dir: the actor's starting weights. pool: the actor's devices.
        role: ``actor``, or ``critic`` for PPO's separated critic (its own pool and process group,
            the actor's layout; driven through :class:`~mindspeed_rl.workers.critic_view.CriticView`).
    """

    def __init__(self, config: Any, model_dir: str, pool: ResourcePool, role: str = "actor") -> None:
        import ray

        self.config, self.dp, self.role = config, config.actor.dp, role
        world = config.actor_world_size()
        worker_class = ray.remote(ActorWorker)
        self.workers = [
            worker_class.options(**pool.options(i)).remote(i, world, config, model_dir, role) for i in range(world)
        ]
        host, port = ray.get(self.workers[0].address.remote())
        self.places: list[dict[str, int]] = ray.get([w.setup.remote(host, port) for w in self.workers])
        last = config.actor.pp - 1
        # The log-probs of a replica are read from its last pipeline stage's first tensor rank.
        self.readers = {
            p["dp_rank"]: i for i, p in enumerate(self.places) if p["pp_rank"] == last and p["tp_rank"] == 0
        }
        self.engine_workers = [self.workers[i] for i, p in enumerate(self.places) if p["engine"]]
        self.version = 0

    # -- data parallelism --------------------------------------------------------------------

    def _split(self, pairs: Sequence[Pair]) -> list[list[int]]:
        lengths = [len(p) + len(r) for p, r in pairs]
        equal = len(pairs) % self.dp == 0
        return balanced_partitions(lengths, self.dp, equal_size=equal)

    def _run(self, method: str, per_dp: list[tuple[Any, ...]]) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote(*per_dp[self.places[i]["dp_rank"]]) for i, w in enumerate(self.workers)]
        return ray.get(refs)

    def compute_logprobs(self, pairs: Sequence[Pair], reference: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs of every response (the actor's, or the reference's), in order."""
        shares = self._split(pairs)
        results = self._run("compute_logprobs", [([pairs[i] for i in share], reference) for share in shares])
        out: list[torch.Tensor | None] = [None] * len(pairs)
        for dp_rank, share in enumerate(shares):
            for i, logp in zip(share, results[self.readers[dp_rank]]):
                out[i] = logp
        return out  # type: ignore[return-value]

    def update(
        self,
        pairs: Sequence[Pair],
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
        rollout_logp: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step over all ``pairs``, each replica on its share (gradients all-reduced)."""
        shares = self._split(pairs)

        def cut(t: torch.Tensor | None, share: list[int]) -> torch.Tensor | None:
            return None if t is None else t[torch.tensor(share, dtype=torch.long)]

        args = [
            (
                [pairs[i] for i in s],
                cut(old_logp, s),
                cut(advantages, s),
                cut(ref_logp, s),
                cut(rollout_logp, s),
                cut(loss_mask, s),
            )
            for s in shares
        ]
        return self.merge_metrics(self._run("update", args))

    def merge_metrics(self, results: list[dict[str, float]]) -> dict[str, float]:
        """The replicas' update metrics as one: each replica already reports the whole batch's means
        (``Actor.update`` sums its metrics over the replicas), so rank 0's, with ``update_tokens`` summed."""
        readers = [results[self.readers[d]] for d in range(self.dp)]
        merged = dict(readers[0])
        if "update_tokens" in merged:
            merged["update_tokens"] = sum(r.get("update_tokens", 0.0) for r in readers)
        return merged

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method(*args)`` on every worker (collective); the results in rank order."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def phase_stats(self) -> dict[str, float]:
        """Timings and memory of the last phases: the maximum over the workers."""
        merged: dict[str, float] = {}
        for stats in self.call("phase_stats"):
            for key, value in stats.items():
                merged[key] = max(value, merged.get(key, value))
        return merged


class ReferenceView:
    """The frozen reference inside the actor workers, with an ``Actor``-like ``compute_logprobs``."""

    def __init__(self, group: ActorGroup) -> None:
        self.group = group

    def compute_logprobs(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """The reference's per-token log-probs of every response."""
        return self.group.compute_logprobs(pairs, reference=True)


def _generate_over(workers: Sequence[Any], prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
    import ray

    shares = _shares(len(prompts), len(workers))
    refs = [w.generate.remote([prompts[i] for i in s], [params[i] for i in s]) for w, s in zip(workers, shares) if s]
    return [out for part in ray.get(refs) for out in part]


def _agent_over(
    workers: Sequence[Any],
    agent: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    conversations: Sequence[Any],
) -> list[Any]:
    import ray

    shares = _shares(len(prompts), len(workers))
    loop = ray.put(agent)  # its tokenizer and tools, shipped once per call
    refs = [
        w.agent_generate.remote(loop, [prompts[i] for i in s], [params[i] for i in s], [conversations[i] for i in s])
        for w, s in zip(workers, shares)
        if s
    ]
    return [out for part in ray.get(refs) for out in part]


class ColocatedRollout:
    """The engines inside the actor workers (co-located mode), as one engine."""

    def __init__(self, group: ActorGroup) -> None:
        self.group = group

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """Generate on the replicas' engines (their training state offloaded meanwhile)."""
        return _generate_over(self.group.engine_workers, prompts, params)

    def agent_generate(
        self, agent: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], conversations: Sequence[Any]
    ) -> list[Any]:
        """Multi-turn rollouts: each replica runs ``agent`` (the driver's ``AgentLoop``) on its share."""
        return _agent_over(self.group.engine_workers, agent, prompts, params, conversations)

    def sync(self, version: int) -> float:
        """Load the actor's weights into the co-located engines (collective); the seconds it took."""
        start = time.perf_counter()
        self.group.call("sync_weights")
        return time.perf_counter() - start


class RolloutPool:
    """The engines of a separated rollout pool, as one engine; dead workers are restarted and refilled.

    Args:
        config: the GRPO recipe. model_dir: the starting weights. pool: the rollout devices.
        max_recoveries: restarts tolerated per call before giving up.
    """

    def __init__(self, config: Any, model_dir: str, pool: ResourcePool, max_recoveries: int = 3) -> None:
        import ray

        worker_class = ray.remote(RolloutWorker)
        self.workers = [
            worker_class.options(max_restarts=-1, max_task_retries=0, **pool.options(i)).remote(i, config, model_dir)
            for i in range(pool.size)
        ]
        ray.get([w.ready.remote() for w in self.workers])
        self.weights: tuple[list[Any], int] | None = None
        self.max_recoveries = max_recoveries
        self.recoveries = 0

    def _with_recovery(self, call: Any) -> Any:
        from ray.exceptions import RayActorError

        for attempt in range(self.max_recoveries + 1):
            try:
                return call()
            except RayActorError as err:
                if attempt == self.max_recoveries:
                    raise RuntimeError(
                        f"a rollout worker died {attempt + 1} times in one call; giving up: {err}"
                    ) from err
                logger.warning("a rollout worker died (%s); waiting for Ray to restart it", type(err).__name__)
                self.recover()
        raise AssertionError("unreachable")

    def recover(self, timeout: float = 300.0) -> None:
        """Wait until every worker answers again, then push the current weights into all of them."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while True:
                try:
                    ray.get(worker.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"a rollout worker did not come back within {timeout} s") from None
                    time.sleep(0.5)
        self.recoveries += 1
        if self.weights is not None:
            ray.get([w.load_weights.remote(*self.weights) for w in self.workers])

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """Generate on the pool's engines (a worker that dies is restarted and the call runs again)."""
        return self._with_recovery(lambda: _generate_over(self.workers, prompts, params))

    def agent_generate(
        self, agent: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], conversations: Sequence[Any]
    ) -> list[Any]:
        """Multi-turn rollouts: each worker runs ``agent`` (the driver's ``AgentLoop``) on its share."""
        return self._with_recovery(lambda: _agent_over(self.workers, agent, prompts, params, conversations))

    def load_weights(self, state: list[Any], version: int) -> float:
        """Push weights (``[ObjectRef]`` from ``ActorWorker.export_weights``) into every engine; seconds taken."""
        import ray

        start = time.perf_counter()
        self.weights = (state, version)
        self._with_recovery(lambda: ray.get([w.load_weights.remote(state, version) for w in self.workers]))
        return time.perf_counter() - start

    def phase_stats(self) -> dict[str, float]:
        """Memory of the last generation: the maximum over the workers."""
        import ray

        merged: dict[str, float] = {}
        for stats in ray.get([w.phase_stats.remote() for w in self.workers]):
            for key, value in stats.items():
                merged[key] = max(value, merged.get(key, value))
        return merged
