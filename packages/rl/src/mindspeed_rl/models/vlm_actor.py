"""The vision-language GRPO actor: a ``mindspeed_mm`` transformers VLM (Qwen2.5-VL, Qwen3-VL) with its
AdamW, scored and updated with the registered policy losses of :mod:`mindspeed_rl.algorithms`.

It serves the in-process GRPO step (:func:`mindspeed_rl.driver.trainer.train_on_batch`) as the megatron
:class:`~mindspeed_rl.models.actor.Actor` does: ``compute_logprobs(pairs)``, ``update(pairs, old_logp,
advantages, ref_logp, rollout_logp)``, ``version``, ``hf_state()``, ``close()``. A pair's prompt is a
:class:`~mindspeed_rl.rollout.vlm.VisionPrompt` (token ids with the image inputs attached).

A microbatch is ``micro_batch_size`` sequences ``prompt + response``, right-padded with an attention
mask, their images concatenated in row order; the log-prob of response token ``t`` is read from the
logits at the position before it. The loss is the registered loss over the whole mini-batch
(``num_tokens`` / ``num_seqs`` of the mini-batch: microbatch losses add up to the mini-batch's).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models import family_of, load_model
from mindspeed_rl.algorithms.functional import logprobs_from_logits
from mindspeed_rl.algorithms.losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs, compute_policy_loss
from mindspeed_rl.rollout.vlm import VisionPrompt

Pair = tuple[VisionPrompt, list[int]]
#: Metrics the update reports (token-weighted means over the mini-batch).
VLM_UPDATE_METRICS = ("pg_clipfrac", "ppo_kl", "approx_kl", "kl_loss", "ratio_mean")


@dataclass(frozen=True)
class VisionActorSettings:
    """Optimizer, batching and loss of the vision-language actor (the recipe's ``actor`` / ``algorithm``)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    micro_batch_size: int = 8
    loss: str = "ppo_clip"
    loss_config: PolicyLossConfig | None = None
    seed: int = 1234


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """``[rows, width]`` float32, each row's values first, zeros after."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def batch_model_inputs(pairs: Sequence[Pair], model: Any) -> dict[str, Any]:
    """Forward inputs of ``prompt + response`` rows: right-padded ids and mask, images in row order."""
    lengths = [len(p) + len(r) for p, r in pairs]
    width = max(lengths)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    mask = torch.zeros(len(pairs), width, dtype=torch.long)
    types = torch.zeros(len(pairs), width, dtype=torch.int32)
    vision: dict[str, list[torch.Tensor]] = {}
    for row, (prompt, response) in enumerate(pairs):
        n = len(prompt)
        ids[row, : lengths[row]] = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        mask[row, : lengths[row]] = 1
        types[row, :n] = prompt.encoded.mm_token_type_ids
        for key, value in prompt.encoded.vision.items():
            vision.setdefault(key, []).append(value)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # M-RoPE families need them
        inputs["mm_token_type_ids"] = types
    for key, values in vision.items():
        inputs[key] = torch.cat(values)
    return inputs


def response_logprobs(model: Any, pairs: Sequence[Pair]) -> list[torch.Tensor]:
    """Per row, the log-probs of the response tokens given the prompt and its images (one forward)."""
    logits = model(**batch_model_inputs(pairs, model)).logits
    out = []
    for row, (prompt, response) in enumerate(pairs):
        n, m = len(prompt), len(response)
        labels = torch.tensor(response, dtype=torch.long)
        out.append(logprobs_from_logits(logits[row, n - 1 : n + m - 1].float(), labels))
    return out


class VisionActor:
    """The policy (trainable) or a frozen reference: the family's transformers model loaded by ``mindspeed_mm``.

    Args:
        model_dir: a Hugging Face directory of a registered ``mindspeed_mm`` family.
        settings: optimizer, batching and loss.
        trainable: False for a frozen reference (no optimizer).
        attn_implementation: ``mindspeed`` (the multimodal suite's attention) or a transformers name.
    """

    def __init__(
        self,
        model_dir: str | Path,
        settings: VisionActorSettings,
        trainable: bool = True,
        attn_implementation: str = "mindspeed",
    ) -> None:
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.model = load_model(model_dir, family_of(model_dir), attn_implementation=attn_implementation)
        self.model.train(trainable)
        self.model.requires_grad_(trainable)
        self.optimizer = (
            torch.optim.AdamW(
                self.model.parameters(),
                lr=settings.lr,
                betas=(settings.adam_beta1, settings.adam_beta2),
                weight_decay=settings.weight_decay,
            )
            if trainable
            else None
        )
        self.version = 0
        self.streak = 0
        self.lora = None  # the LoRA actor's reference is not offered here

    def _micro(self, pairs: Sequence[Pair]) -> list[slice]:
        size = self.settings.micro_batch_size
        return [slice(i, i + size) for i in range(0, len(pairs), size)]

    def compute_logprobs(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """Per row, the log-probs of its response tokens (no gradient)."""
        with torch.no_grad():
            return [lp for part in self._micro(pairs) for lp in response_logprobs(self.model, pairs[part])]

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names (for the rollout engine)."""
        return {name: value.detach() for name, value in self.model.state_dict().items()}

    def update(
        self,
        pairs: Sequence[Pair],
        old_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None,
        rollout_logp: torch.Tensor | None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch; its metrics (``loss``, ``grad_norm``, ``pg_clipfrac``, ...).

        A non-finite loss or gradient norm skips the step (``skipped`` 1, ``nonfinite_streak`` counts them).
        """
        if self.optimizer is None:
            raise ValueError("a frozen reference actor has no update; build it with trainable=True")
        config = self.settings.loss_config or POLICY_LOSSES.get(self.settings.loss).defaults
        width = max(len(r) for _, r in pairs)
        for given in (old_logp, ref_logp, rollout_logp, loss_mask):
            width = max(width, given.shape[-1]) if given is not None else width
        mask = pad_rows([torch.ones(len(r)) for _, r in pairs], width)
        if loss_mask is not None:
            mask = mask * loss_mask
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand(-1, width)
        totals = {"tokens": float(mask.sum()), "seqs": float(len(pairs))}
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for part in self._micro(pairs):
            logp = pad_rows(response_logprobs(self.model, pairs[part]), width)  # differentiable (CopySlices)
            inputs = PolicyLossInputs(
                logp=logp,
                old_logp=(old_logp[part] if old_logp is not None else logp.detach()).float(),
                advantages=adv[part].float(),
                mask=mask[part],
                ref_logp=None if ref_logp is None else ref_logp[part].float(),
                rollout_logp=None if rollout_logp is None else rollout_logp[part].float(),
                num_tokens=totals["tokens"],
                num_seqs=totals["seqs"],
            )
            out = compute_policy_loss(self.settings.loss, inputs, config)
            out.loss.backward()
            tokens = float(mask[part].sum())
            sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach())
            for name in VLM_UPDATE_METRICS:
                if name in out.metrics:
                    sums[name] = sums.get(name, 0.0) + float(out.metrics[name]) * tokens
        return self._step(sums, totals, pairs)

    def _step(self, sums: dict[str, float], totals: dict[str, float], pairs: Sequence[Pair]) -> dict[str, float]:
        clip = self.settings.clip_grad or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        finite = math.isfinite(norm) and math.isfinite(sums.get("loss", 0.0))
        if finite:
            self.optimizer.step()
        self.streak = 0 if finite else self.streak + 1
        self.version += 1
        metrics = {"loss": sums.get("loss", float("nan"))}
        metrics.update({n: sums[n] / max(totals["tokens"], 1.0) for n in VLM_UPDATE_METRICS if n in sums})
        metrics.update(
            grad_norm=norm,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            skipped=0.0 if finite else 1.0,
            nonfinite_streak=float(self.streak),
            update_tokens=float(sum(len(p) + len(r) for p, r in pairs)),
        )
        return metrics

    def close(self) -> None:
        """Nothing to undo (the model is transformers' own; kept for the trainer's protocol)."""
