"""The rollout-engine interface, its registry and :func:`build_rollout`.

A rollout engine turns prompt token ids into sampled responses with the log-probability of every
sampled token, takes new weights from the trainer as full (unsharded) Hugging Face-named tensors,
and can give its device memory back while the trainer runs on the same devices (co-location).
Engines register a factory in :data:`ROLLOUT_ENGINES`; :func:`build_rollout` builds one by name.
Both shipped engines return :class:`~mindspeed_llm.inference.GenerationOutput` objects and take
:class:`~mindspeed_llm.inference.SamplingParams`, so the trainer does not know which one runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mindspeed.registry import Registry
from mindspeed_llm.engine import GenerationOutput, SamplingParams

#: What an engine returns per prompt: ``prompt_token_ids``, ``token_ids``, ``logprobs`` (one per
#: generated token, log-softmax of the model's logits before temperature / top-k / top-p) and
#: ``finish_reason`` (``"stop"`` or ``"length"``).
RolloutOutput = GenerationOutput


@runtime_checkable
class RolloutEngine(Protocol):
    """What the GRPO trainer and the Ray workers need from an inference engine."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[RolloutOutput]:
        """One sampled response per prompt, with its per-token log-probabilities.

        A sleeping engine wakes itself first.

        Args:
            prompt_ids: token ids of each prompt.
            params: the sampling settings of each prompt (same length as ``prompt_ids``).

        Returns:
            One output per prompt, in order.
        """
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights with Hugging Face-named, full (unsharded) tensors.

        May be called while asleep; the weights are in place when the engine next generates.
        """
        ...

    def sleep(self) -> None:
        """Give device memory back (KV cache, and the weights where the engine can) for co-location."""
        ...

    def wake_up(self) -> None:
        """Take the memory again (no-op when awake)."""
        ...


#: A factory: ``(model_dir, max_num_seqs=, tp=, gpu_memory_utilization=, seed=, max_model_len=, **options)``.
RolloutFactory = Callable[..., RolloutEngine]

#: Engine name -> factory (``builtin``, ``vllm``).
ROLLOUT_ENGINES: Registry[RolloutFactory] = Registry("rollout engine")


def build_rollout(
    name: str,
    model_dir: str | Path,
    *,
    max_num_seqs: int = 64,
    tp: int = 1,
    gpu_memory_utilization: float = 0.5,
    seed: int = 0,
    max_model_len: int | None = None,
    **options: Any,
) -> RolloutEngine:
    """Build the rollout engine ``name`` on the Hugging Face checkpoint in ``model_dir``.

    Args:
        name: a key of :data:`ROLLOUT_ENGINES` (``builtin`` or ``vllm``).
        model_dir: Hugging Face directory (config.json, safetensors, tokenizer); ``builtin`` also
            reads Megatron checkpoints.
        max_num_seqs: sequences decoded at once.
        tp: tensor-parallel size of the engine (``builtin``: 1 only).
        gpu_memory_utilization: share of device memory the engine may take (``vllm``; the
            ``builtin`` engine allocates what a call needs).
        seed: seed of requests that carry none (so runs repeat).
        max_model_len: prompt plus response tokens per request (default: the model's limit).
        options: engine-specific settings (``builtin``: ``dtype``, ``device``, ``kernels``;
            ``vllm``: more ``vllm.LLM`` arguments, e.g. ``enforce_eager=True``).

    Returns:
        The engine.

    Raises:
        ValueError: an unknown engine name (listing the known ones), a bad setting, or an engine
            whose package is not installed (naming the extra to install).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
    factory = ROLLOUT_ENGINES.get(name)
    return factory(
        model_dir,
        max_num_seqs=max_num_seqs,
        tp=tp,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        max_model_len=max_model_len,
        **options,
    )


def check_params(prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """``params`` as a list, checked to give one :class:`SamplingParams` per prompt.

    Raises:
        ValueError: a count mismatch.
    """
    params = [params] * len(prompt_ids) if isinstance(params, SamplingParams) else list(params)
    if len(params) != len(prompt_ids):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_ids)} prompts; pass one per prompt")
    return params
