"""Rollout workers: the inference engine in its own Ray process (separated mode) or inside an actor worker.

:func:`build_engine` makes the recipe's engine (``rollout.engine``). A :class:`RolloutWorker`
holds one engine on one device of the rollout pool; the driver pushes the actor's weights into
it after every update (:meth:`RolloutWorker.load_weights` reads them from Ray's object store).
Workers are started with ``max_restarts``: one that dies is started again by Ray with its first
weights, and the driver pushes the current ones before it generates again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed_rl.models.memory import freeze_startup_objects, memory_gib
from mindspeed_rl.rollout import build_rollout


def build_engine(config: Any, model_dir: str) -> Any:
    """The rollout engine of a recipe, with the weights in ``model_dir``.

    Raises:
        ValueError: an engine this version cannot build (naming ``rollout.engine``).
    """
    r = config.rollout
    return build_rollout(
        r.engine,
        model_dir,
        max_num_seqs=r.max_num_seqs,
        tp=r.tp,
        gpu_memory_utilization=r.gpu_memory_utilization,
        seed=config.train.seed,
        max_model_len=r.max_prompt_length + r.max_new_tokens,
        **({"compile": True} if r.compile else {}),  # the builtin engine's option (RolloutConfig.check)
    )


class RolloutWorker:
    """One engine of a separated rollout pool (wrapped by ``ray.remote`` when the pool starts it).

    Args:
        index: the worker's place in the pool.
        config: the GRPO recipe.
        model_dir: the resolved actor model directory (the engine's first weights).
    """

    def __init__(self, index: int, config: Any, model_dir: str) -> None:
        acc = get_accelerator()
        if acc.ray_resource:
            acc.set_device(0)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.index, self.config = index, config
        self.engine = build_engine(config, model_dir)
        self.version = 0
        self.stats: dict[str, float] = {}
        freeze_startup_objects()

    def ready(self) -> int:
        """The policy version of the weights loaded (answers once the engine is built)."""
        return self.version

    def load_weights(self, state: list[Any], version: int) -> float:
        """Load weights from ``[ObjectRef]`` (from ``ActorWorker.export_weights``); returns the seconds it took."""
        import ray

        start = time.perf_counter()
        value = state[0]
        weights = ray.get(value) if isinstance(value, ray.ObjectRef) else value
        self.engine.load_weights(weights)
        self.version = version
        return time.perf_counter() - start

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """Generate one response per prompt with the loaded weights."""
        outputs = self.engine.generate(list(prompts), list(params))
        self.stats.update({f"memory/rollout_{k}": v for k, v in memory_gib().items()})
        return outputs

    def agent_generate(
        self, agent: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], conversations: Sequence[Any]
    ) -> list[Any]:
        """Multi-turn rollouts of the driver's agent loop on this engine, the tools run here
        (overlapped with the generation on the built-in engine; see ``AgentLoop.run``)."""
        outputs = agent.run(self.engine, list(prompts), list(params), list(conversations))
        self.stats.update({f"memory/rollout_{k}": v for k, v in memory_gib().items()})
        return outputs

    def phase_stats(self) -> dict[str, float]:
        """Memory of the last generation."""
        return dict(self.stats)
