"""LoRA RL on the actor: the adapters train, the base is the reference, the engine gets merged weights.

:class:`ActorLora` is a part of :class:`~mindspeed_rl.models.actor.Actor` (built with
``ActorSettings.lora``: the LLM suite's :func:`~mindspeed_llm.engine.apply_lora` runs on the bare
chunks after the base weights are loaded, so megatron's DDP and optimizer only see the factors):

- :meth:`ActorLora.adapters_off`: the actor computes its base model's outputs within the block
  (:func:`~mindspeed_llm.engine.lora_disabled`); :class:`AdapterOffReference` is the KL reference
  built on it, an ``Actor``-like ``compute_logprobs`` with no weights of its own;
- :meth:`ActorLora.merged_weights`: within the block each adapted linear's weight is
  ``W + (alpha / r) B A`` (this rank's piece, computed in float32 and cast to the weight's dtype),
  in a new storage: the base ``W`` is put back untouched afterwards (bit for bit), and the tensors
  a weight export took from the merged storages stay valid after the block;
- :meth:`ActorLora.export_peft`: the adapter as a PEFT directory for the Hugging Face base
  (:func:`~mindspeed_llm.engine.export_peft`);
- :meth:`ActorLora.save_checkpoint`: the run's checkpoint; under LoRA adapters-only (the factors,
  their Adam moments, the schedule and the RNG, not the frozen base): a resume builds the actor
  from its model path (the base) and loads the factors with ``load_model_checkpoint``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mindspeed_llm.engine import (
    export_peft,
    lora_delta_weight,
    lora_disabled,
    lora_layers,
    save_model_checkpoint,
    unwrap,
)

Pair = tuple[Sequence[int], Sequence[int]]


class ActorLora:
    """The LoRA part of the actor (reads ``chunks``, ``settings``, ``shape``, ``hf_dir``, ``groups``)."""

    chunks: list[Any]
    settings: Any
    shape: Any
    hf_dir: str
    groups: Any

    @property
    def lora(self) -> bool:
        """Whether the actor trains LoRA adapters (its base weights are frozen)."""
        return self.settings.lora is not None and self.optimizer is not None  # type: ignore[attr-defined]

    def _lora_layers(self) -> list[Any]:
        return [layer for chunk in self.chunks for layer in lora_layers(unwrap(chunk)).values()]

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Within the block the actor is its base model (the LoRA terms are skipped)."""
        with lora_disabled(self.chunks):
            yield

    @contextlib.contextmanager
    def merged_weights(self) -> Iterator[None]:
        """Within the block each adapted linear's weight is ``W + (alpha / r) B A`` (see the module)."""
        saved = []
        try:
            with torch.no_grad():
                for layer in self._lora_layers():
                    weight = layer.weight
                    saved.append((weight, weight.data))
                    weight.data = (weight.data.float() + lora_delta_weight(layer)).to(weight.dtype)
            yield
        finally:
            for weight, data in saved:
                weight.data = data

    def export_peft(self, directory: str | Path) -> None:
        """Write the adapter as a PEFT adapter directory for the base in ``hf_dir`` (collective)."""
        if not self.lora:
            raise ValueError("this actor has no LoRA adapters (set actor.lora.target_modules)")
        export_peft(self.chunks, directory, self.shape, self.hf_dir, self.settings.lora, self.groups)

    def save_checkpoint(
        self, root: str | Path, step: int, extra_files: dict[str, str] | None = None, keep_last: int | None = None
    ) -> Path:
        """Save ``root/iter_<step>`` (collective): the whole actor, or under LoRA its adapters only.

        An adapters-only checkpoint holds the factors, their optimizer state, the schedule and the
        RNG; the frozen base is not written: the actor a resume builds reads it from its model path
        (``actor.model``), then ``load_model_checkpoint`` loads the rest.
        """
        return save_model_checkpoint(root, step, self, extra_files, keep_last, adapters_only=self.lora)

    def trainable_parameters(self) -> int:
        """Elements of this rank's trained parameters (the LoRA factors under LoRA)."""
        return sum(p.numel() for chunk in self.chunks for p in unwrap(chunk).parameters() if p.requires_grad)


class AdapterOffReference:
    """The KL reference of a LoRA actor: the same model with its adapters off (no weights of its own).

    Args:
        actor: the LoRA actor (an :class:`~mindspeed_rl.models.actor.Actor` with ``settings.lora``).
    """

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def compute_logprobs(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """The base model's per-token log-probs of each response (see ``Actor.compute_logprobs``)."""
        with self.actor.adapters_off():
            return self.actor.compute_logprobs(pairs)

    def offload(self, **_: bool) -> dict[str, int]:
        """Nothing to move: the weights are the actor's (it offloads them itself)."""
        return {}
