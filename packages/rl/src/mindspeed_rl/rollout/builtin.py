"""The ``builtin`` rollout engine: the LLM suite's :class:`~mindspeed_llm.inference.InferenceEngine`.

It runs wherever torch runs (CPU, GPU, NPU: kernels come from the registry), on one device, with
a KV cache and continuous batching. Its log-probabilities are those of the model's logits
before temperature / top-k / top-p, the quantity the trainer's old log-probs measure too, so
``rollout_logp_diff`` is near 0 after a weight sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mindspeed_llm.engine import GenerationOutput, GenerationSession, InferenceEngine, SamplingParams
from mindspeed_rl.rollout.base import ROLLOUT_ENGINES, RolloutOutput, check_params


class BuiltinRollout:
    """:class:`~mindspeed_rl.rollout.base.RolloutEngine` over an :class:`InferenceEngine`.

    ``sleep`` frees the KV cache (:meth:`InferenceEngine.free_cache`); the weights stay where they
    are (the engine's weight tensors are views into shared storage that a move would break, and
    the built-in engine serves models small enough to keep). The next ``generate`` allocates a
    cache sized for its batch again.

    Args:
        engine: the engine to drive.
        seed: seeds the per-request seeds of sampled requests that carry none, so that a run
            repeats without touching torch's global generator.
    """

    def __init__(self, engine: InferenceEngine, seed: int = 0) -> None:
        self.engine = engine
        self._seeds = torch.Generator().manual_seed(seed)
        self.asleep = False

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        max_num_seqs: int = 64,
        tp: int = 1,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        max_model_len: int | None = None,
        **options: Any,
    ) -> BuiltinRollout:
        """The engine on a Hugging Face directory or Megatron checkpoint (see :func:`build_rollout`).

        ``gpu_memory_utilization`` is accepted for a uniform signature and not used: the built-in
        engine allocates the cache a call needs.

        Args:
            model_dir: the checkpoint.
            max_num_seqs: requests decoded at once.
            tp: must be 1 (the built-in engine runs on one device).
            gpu_memory_utilization: ignored.
            seed: seed of the per-request seeds.
            max_model_len: prompt plus response tokens per request.
            options: :meth:`InferenceEngine.from_pretrained` keywords (``dtype``, ``device``, ``kernels``,
                ``compile`` (``rollout.compile``: the decode step under ``torch.compile``), ...).

        Raises:
            ValueError: ``tp`` above 1, or a checkpoint the engine cannot read.
        """
        if tp != 1:
            raise ValueError(
                f"the builtin rollout engine runs on one device, got tp={tp}; set rollout.tp=1 "
                "or use rollout.engine=vllm for tensor-parallel rollout"
            )
        del gpu_memory_utilization
        engine = InferenceEngine.from_pretrained(
            model_dir, max_batch_size=max_num_seqs, max_seq_len=max_model_len, **options
        )
        return cls(engine, seed)

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (``None`` when it has none)."""
        return self.engine.tokenizer

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[RolloutOutput]:
        """One response per prompt (see :meth:`InferenceEngine.generate`); wakes a sleeping engine.

        Raises:
            ValueError: a params count that does not match the prompts, or a prompt the engine rejects.
        """
        params = check_params(prompt_ids, params)
        if self.asleep:
            self.wake_up()
        return self.engine.generate(prompt_ids, [self._seeded(p) for p in params])

    def session(self, slots: int, max_len: int) -> BuiltinSession:
        """A step-wise generation session (requests join between steps; the agent loop's overlapped
        mode); wakes a sleeping engine. Requests without a seed get one as in :meth:`generate`.

        Args:
            slots: requests decoded at once (capped by ``max_num_seqs``).
            max_len: prompt plus generated tokens of any request (capped by ``max_model_len``).
        """
        if self.asleep:
            self.wake_up()
        return BuiltinSession(GenerationSession(self.engine, slots, max_len), self._seeded)

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        if params.greedy or params.seed is not None:
            return params
        return dataclasses.replace(params, seed=int(torch.randint(0, 2**62, (), generator=self._seeds)))

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace weights from Hugging Face-named tensors (any subset, e.g. one bucket per call).

        Raises:
            ValueError: a name the model does not have, or a shape that does not match.
        """
        self.engine.load_weights(state)

    def sleep(self) -> None:
        """Free the KV cache."""
        self.engine.free_cache()
        self.asleep = True

    def wake_up(self) -> None:
        """Mark the engine awake (the next ``generate`` allocates its cache)."""
        self.asleep = False


class BuiltinSession:
    """A :class:`~mindspeed_llm.engine.GenerationSession` whose requests are seeded as :class:`BuiltinRollout` seeds them."""

    def __init__(self, session: GenerationSession, seeded: Callable[[SamplingParams], SamplingParams]) -> None:
        self._session, self._seeded = session, seeded

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or running."""
        return self._session.busy

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request (see :meth:`GenerationSession.submit`); returns its id."""
        return self._session.submit(prompt, self._seeded(params))

    def step(self) -> list[tuple[int, GenerationOutput]]:
        """One engine iteration; the requests it finished as ``(id, output)``."""
        return self._session.step()


@ROLLOUT_ENGINES.register("builtin")
def build_builtin(model_dir: str | Path, **settings: Any) -> BuiltinRollout:
    """Registry factory of :class:`BuiltinRollout` (keywords of :meth:`BuiltinRollout.from_pretrained`)."""
    return BuiltinRollout.from_pretrained(model_dir, **settings)
