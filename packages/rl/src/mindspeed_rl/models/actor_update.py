"""The GRPO actor's update: the policy loss of a microbatch and one optimizer step.

:class:`ActorUpdate` is a part of :class:`~mindspeed_rl.models.actor.Actor` (its public ``update``
runs :meth:`ActorUpdate._update` under the fast path). The loss is a megatron ``LossFunc`` that
gathers the response tokens of each sequence into ``[sequences, max response length]`` and
calls the registered :func:`~mindspeed_rl.algorithms.compute_policy_loss` with
``num_tokens=1`` / ``num_seqs=1``: a *sum*, returned with its count, which megatron divides the
gradients by over the whole step (``calculate_per_token_loss``).

A MoE policy's routers add their auxiliary losses (``load_balancing_loss``, ``z_loss`` ...) to
megatron-core's process-wide tracker in every training forward; the update reads them after its
schedule and clears the tracker (:meth:`ActorUpdate._aux_losses`, as the LLM trainer's step does),
so each update reports its own forwards' values and nothing adds up over a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import fault_armed, plant_nan
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.metrics.moe import moe_aux_losses
from mindspeed_llm.engine import guarded_step
from mindspeed_rl.algorithms.losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs, compute_policy_loss
from mindspeed_rl.models.actor_packing import Pair

logger = get_logger("mindspeed_rl.models.actor")

#: Metrics the update reports (token-weighted means over the step, except ``loss``).
UPDATE_METRICS = (
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "ppo_kl",
    "approx_kl",
    "kl_loss",
    "ratio_mean",
    "tis_weight_mean",
    "tis_clipfrac",
    "pg_clipfrac_lower",
    "entropy",
)


class ActorUpdate:
    """The policy loss and the optimizer step of the actor (reads its settings, chunks,
    optimizer, scheduler, groups, skips, version and loss_stage; packs and runs with its ``_microbatches``,
    ``_schedule``, ``_gather`` and ``_logp_entropy``)."""

    settings: Any
    parallel: Any
    groups: Any
    chunks: list[Any]
    transformer: Any
    optimizer: Any
    scheduler: Any
    adaptation: Any
    skips: Any
    version: int
    vocab: int
    hf_vocab: int
    share_prompt: bool

    def _policy_loss(
        self, config: PolicyLossConfig, logits: bool, batch: dict[str, Any], output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["resp_mask"]
        if batch.get("resp_loss_mask") is not None:  # a multi-turn rollout's tool tokens: context, no loss
            mask = mask * batch["resp_loss_mask"]
        if logits:
            # The entropy is a metric (compute_entropy) or a bonus (entropy_coef, with gradient).
            bonus = bool(config.entropy_coef)
            logp, entropy = self._logp_entropy(batch, output, bonus, bonus or self.settings.compute_entropy)
        else:
            logp, entropy = self._gather(batch, output), None
        if entropy is not None and not config.entropy_coef:
            entropy = entropy.detach()  # a metric only: no graph through it
        old = batch.get("old_logp")
        if old is None:  # on-policy: the policy before this update is the current one (ratio 1)
            old = logp.detach()
        inputs = PolicyLossInputs(
            logp=logp,
            old_logp=old,
            entropy=entropy,
            advantages=batch["advantages"],
            mask=mask,
            ref_logp=batch.get("ref_logp"),
            rollout_logp=batch.get("rollout_logp"),
            num_tokens=1.0,
            num_seqs=1.0,
        )
        out = compute_policy_loss(self.settings.loss, inputs, config)
        tokens = mask.sum()
        count = tokens if config.loss_agg_mode == "token-mean" else torch.tensor(float(mask.shape[0]))
        metrics = {"loss": torch.stack([out.loss.detach().float().cpu(), count.float().cpu()])}
        for name in UPDATE_METRICS[1:]:
            if name in out.metrics:
                value = out.metrics[name].float().cpu()
                # pg_loss / kl_loss are sums like the loss; the others are per-token means.
                weight = count.float().cpu() if name in ("pg_loss", "kl_loss") else tokens.float().cpu()
                total = value if name in ("pg_loss", "kl_loss") else value * weight
                metrics[name] = torch.stack([total, weight])
        if batch.get("rollout_logp") is not None:  # engine vs actor on the samples: the weight sync's health
            diff = ((batch["rollout_logp"] - old.detach()).abs() * mask).sum()
            metrics["rollout_logp_diff"] = torch.stack([diff.float().cpu(), tokens.float().cpu()])
        return out.loss, count.to(torch.int), metrics

    def _update(
        self,
        pairs: Sequence[Pair],
        old_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None,
        rollout_logp: torch.Tensor | None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        longest = max(len(r) for _, r in pairs)
        padded = [
            t
            for t in (old_logp, ref_logp, rollout_logp, loss_mask, advantages if advantages.dim() == 2 else None)
            if t is not None
        ]
        width = padded[0].shape[-1] if padded else longest
        if old_logp is not None and (old_logp.shape[0] != len(pairs) or width < longest):
            raise ValueError(f"old_logp {tuple(old_logp.shape)} does not fit {len(pairs)} responses")
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand(-1, width)
        extra = {"advantages": adv.float()}
        if old_logp is not None:
            extra["old_logp"] = old_logp.float()
        if ref_logp is not None:
            extra["ref_logp"] = ref_logp.float()
        if rollout_logp is not None:
            extra["rollout_logp"] = rollout_logp.float()
        if loss_mask is not None:
            extra["resp_loss_mask"] = loss_mask.float()  # not "loss_mask": the packed batch has one
        config = self.settings.loss_config or POLICY_LOSSES.get(self.settings.loss).defaults
        if ref_logp is None and config.kl_coef:
            raise ValueError(f"kl_coef={config.kl_coef}: pass ref_logp (from a reference actor)")
        batches = self._microbatches(pairs, width, extra)
        if self.dualpipev and len(batches) < 2 * self.parallel.pp:
            raise ValueError(
                f"dualpipev: the update has {len(batches)} microbatches, it needs >= 2 x actor.pp = "
                f"{2 * self.parallel.pp}; lower actor.micro_batch_size or update more sequences at once"
            )
        logits = (
            self.settings.compute_entropy
            or bool(config.entropy_coef)
            or self.vocab != self.hf_vocab
            or self.share_prompt
        )
        hooks = self.adaptation.hooks
        for hook in hooks.get("pre_step", ()):
            hook(self.version + 1)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._schedule(batches, partial(self._policy_loss, config, logits), forward_only=False, logits=logits)
        lr = float(self.optimizer.param_groups[0]["lr"])
        totals = self._metric_totals(outputs)
        metrics = {name: (sm / n if n else float("nan")) for name, (sm, n) in totals.items()}
        metrics.update(self._aux_losses(len(batches)))
        update = self.version + 1
        if fault_armed("train.grad_nan", update) and dist.get_rank() == 0:
            plant_nan(self.chunks[0].buffers[0].grad_data)  # rank 0's own shard, as the LLM trainer's
        # A NaN/Inf loss or gradient norm on any rank: no update and no schedule step on every rank.
        outcome = guarded_step(self.optimizer, metrics.get("loss", 0.0), get_accelerator().device())
        if outcome.applied:
            self.scheduler.step(increment=1)  # the next update's learning rate
        diverged = outcome.reason in ("loss", "grad_norm")
        self.skips.record(outcome.applied, diverged)
        if diverged and dist.get_rank() == 0:
            logger.warning(self.skips.skip_line(update, metrics.get("loss", 0.0), outcome.grad_norm))
        self.version = update
        for hook in hooks.get("post_step", ()):
            hook(self.version)
        grad_norm = outcome.grad_norm
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["skipped"] = 0.0 if outcome.applied else 1.0
        metrics["nonfinite_streak"] = float(self.skips.streak)
        metrics["lr"] = lr
        metrics["update_tokens"] = float(sum(len(p) + len(r) for p, r in pairs))
        return metrics

    def _aux_losses(self, num_microbatches: int) -> dict[str, float]:
        """The MoE auxiliary losses of this update's forwards, then cleared (collective: every rank).

        megatron's logged values (the mean per MoE layer and microbatch, without the coefficient,
        reduced over the pipeline stages and averaged over the data-parallel replicas), under
        megatron's names (``load_balancing_loss``, ``seq_load_balancing_loss``,
        ``global_load_balancing_loss``, ``z_loss``); ``{}`` for a dense model or one without
        balancing losses.
        """
        return moe_aux_losses(self.transformer, num_microbatches, get_accelerator().device())

    def _metric_totals(self, outputs: list[dict[str, Any]]) -> dict[str, list[float]]:
        """``name -> [sum, weight]`` over the microbatches, sent from the last stage to all and summed over
        the data-parallel replicas (the step's means, not one replica's share's)."""
        totals: dict[str, list[float]] = {}
        for item in outputs:
            for name, pair in item.items():
                acc = totals.setdefault(name, [0.0, 0.0])
                acc[0] += float(pair[0])
                acc[1] += float(pair[1])
        pp = self.parallel.pp
        if pp > 1:
            group = self.groups.pp
            box = [totals]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, self.loss_stage), group=group)
            totals = box[0]
        dp = getattr(self.groups, "dp", None)
        if dp is not None and dist.get_world_size(dp) > 1:  # every replica reports the whole batch's means
            shares: list[Any] = [None] * dist.get_world_size(dp)
            dist.all_gather_object(shares, totals, group=dp)
            totals = {}
            for share in shares:  # in rank order: the same sums on every rank
                for name, (sm, n) in share.items():
                    acc = totals.setdefault(name, [0.0, 0.0])
                    acc[0] += sm
                    acc[1] += n
        return totals
