"""PPO's critic: a megatron-core GPT whose output layer is a scalar value head.

The critic is built by the actor's own constructor (:func:`mindspeed_llm.engine.build_engine`: the
model, its own optimizer and schedule, any TP/PP layout; the critic overrides only the hooks
``_prepare_chunks``, ``_engine_options``, ``role`` and ``runs_dualpipev``, so it holds every attribute
the actor's methods read), and its ``prepare`` step turns the fresh chunks into a
value model before they are wrapped (:func:`~mindspeed_rl.models.critic_init.init_value_model`: a reward
model's score head, or a seeded fresh head on a language model's decoder). It packs the
``(prompt ids, response ids)`` pairs exactly as the actor packs them for its log-probs
(:mod:`mindspeed_rl.models.actor_packing`): the value of response token ``j`` is the head's output at the
position whose logits predict token ``j`` (the state before the token is generated, verl's
``values[:, -response_length - 1 : -1]``).

:meth:`Critic.update` is one optimizer step of the registered value loss
(:data:`~mindspeed_rl.algorithms.value_loss.VALUE_LOSSES`, ``critic.value_loss``) against the
returns of GAE: a megatron ``LossFunc`` that returns the *sum* of the per-token losses with the
token count, so that megatron (``calculate_per_token_loss``) divides the gradients by the token
count of the whole step: the ``token-mean`` loss of the global batch however it is split into
microbatches and data-parallel shares. Offload and onload (co-location with the rollout engine)
are the actor's (:class:`~mindspeed_rl.models.actor_memory.ActorMemory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.features import FeaturesConfig
from mindspeed.megatron import fast_path
from mindspeed_llm.engine import guarded_step, load_model_checkpoint
from mindspeed_rl.algorithms.value_loss import ValueLossInputs, compute_value_loss
from mindspeed_rl.models.actor import Actor, ActorSettings
from mindspeed_rl.models.actor_packing import Pair
from mindspeed_rl.models.critic_init import init_value_model, read_critic_source

#: Metrics :meth:`Critic.update` reports (token-weighted means over the step), verl's names without ``critic/``.
CRITIC_METRICS = ("vf_loss", "vf_clipfrac", "vpred_mean")


@dataclass
class CriticSettings(ActorSettings):
    """The actor's settings (optimizer, schedule, batching) plus the value loss.

    Attributes:
        value_loss: a key of ``VALUE_LOSSES`` (``clipped`` or ``mse``).
        cliprange_value: the clip range of the new values around the scored ones.
        head_std: the standard deviation of a fresh value head (a language-model start).
    """

    value_loss: str = "clipped"
    cliprange_value: float = 0.5
    head_std: float = 0.02


class Critic(Actor):
    """A value model built from a Hugging Face directory (a reward model or a language model).

    Shares the actor's construction, packing, schedule, pipeline broadcast, co-location memory and
    MoE aux-loss read; its own optimizer and schedule come from ``settings`` (its layers run eager
    and every weight trains: ``settings.compile`` and ``settings.lora`` are ignored).

    Args:
        hf_dir: a ``*ForSequenceClassification`` (num_labels 1) or ``*ForCausalLM`` directory.
        settings: optimizer, schedule, batching and value-loss settings.
        tp, pp: the layout.
        features: as the actor's (the same in one process).

    Raises:
        ConfigError: an unreadable directory, a classifier with more than one label.
    """

    role = "critic"
    runs_dualpipev = False  # build_engine refuses the dualpipev feature (the value head is not on the V's end)

    def __init__(
        self,
        hf_dir: str,
        settings: CriticSettings | None = None,
        tp: int = 1,
        pp: int = 1,
        features: FeaturesConfig | None = None,
    ) -> None:
        #: The value head's source: a reward model's score head, or a language model's decoder.
        self.source = read_critic_source(str(hf_dir))
        # Every weight trains, eagerly: ``compile`` and ``lora`` are the actor's settings (a PPO
        # recipe's shared batching section carries them), not the critic's.
        s = replace(settings or CriticSettings(), compile=False, lora=None)
        super().__init__(hf_dir, s, trainable=True, tp=tp, pp=pp, features=features)

    def _prepare_chunks(self, load: Any) -> Any:
        """The value model from the fresh chunks: the source's weights and its (or a seeded fresh) head."""
        s = self.settings
        return partial(
            init_value_model,
            source=self.source,
            parallel=self.parallel,
            vocab_rows=self.vocab,
            groups=self.groups,
            std=s.head_std,
            seed=s.seed,
        )

    def _engine_options(self) -> dict[str, Any]:
        return {}  # eager layers (see __init__)

    def _summary(self) -> str:
        return f"critic from {self.hf_dir} ({self.source.kind} head): {self.bridge.family}"

    def load_weights(self, path: str | Path) -> None:
        """Start from the weights of the Megatron checkpoint ``path`` (``critic.load``; collective).

        A PPO run's ``critic/iter_*`` or a ``mindspeed-llm rm`` run's checkpoint (the same model: a
        decoder with a scalar head), saved in any TP/PP layout (resharded); the optimizer, the
        schedule and the random-number states stay fresh.

        Raises:
            ValueError: a tensor's shape differs from this critic's (one line naming both), or a
                file of the checkpoint is refused (nothing in it runs code).
        """
        load_model_checkpoint(Path(path), self, load_optimizer=False, load_rng=False)

    @staticmethod
    def _values(batch: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
        """``[n, width]`` values at the response positions (0 on padding)."""
        rows = output.float().reshape(-1)[batch["resp_index"]]
        return torch.where(batch["resp_mask"].bool(), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def compute_values(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """The value at each response token of each pair (forward only, collective).

        Returns:
            Per pair, a float32 CPU tensor ``[len(response)]`` on every rank (the last pipeline
            stage broadcasts them). Offloaded weights are onloaded first.
        """
        self._onload_categories(("weights",))
        with fast_path():
            width = max(len(r) for _, r in pairs)
            batches = self._microbatches(pairs, width)

            def collect(batch: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {"values": self._values(batch, output)}

            for chunk in self.chunks:
                chunk.eval()
            try:
                with torch.no_grad():
                    outputs = self._schedule(batches, collect, forward_only=True, logits=True)
            finally:
                for chunk in self.chunks:
                    chunk.train()
            if outputs:
                rows = torch.cat([item["values"] for item in outputs]).float()
            else:
                rows = torch.empty(len(pairs), width, device=get_accelerator().device())
            rows = self._broadcast_last_stage(rows.contiguous()).cpu()
        return [rows[i, : len(r)].clone() for i, (_, r) in enumerate(pairs)]

    def _value_loss(
        self, batch: dict[str, Any], output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        s = self.settings
        mask = batch["resp_mask"]
        if batch.get("resp_loss_mask") is not None:  # a multi-turn rollout's tool tokens: no value loss
            mask = mask * batch["resp_loss_mask"]
        inputs = ValueLossInputs(
            vpreds=self._values(batch, output),
            values=batch["values"],
            returns=batch["returns"],
            mask=mask,
            num_tokens=1.0,  # a sum: megatron divides by the step's token count
        )
        out = compute_value_loss(s.value_loss, inputs, s.cliprange_value, "token-mean")
        tokens = mask.sum().float().cpu()
        metrics = {
            "vf_loss": torch.stack([out.loss.detach().float().cpu(), tokens]),
            "vf_clipfrac": torch.stack([torch.tensor(out.metrics["vf_clipfrac"]) * tokens, tokens]),
            "vpred_mean": torch.stack([torch.tensor(out.metrics["vpred_mean"]) * tokens, tokens]),
        }
        return out.loss, mask.sum().to(torch.int), metrics

    def update(  # type: ignore[override]
        self, pairs: Sequence[Pair], values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One optimizer step of the value loss over all ``pairs`` (collective).

        Args:
            pairs: ``(prompt ids, response ids)`` per sequence.
            values: ``[n, width]`` the critic's values when the batch was scored (the clip centre).
            returns: ``[n, width]`` the regression targets (GAE's returns).
            loss_mask: ``[n, width]`` 1 on the response tokens the policy generated, 0 on those it
                did not (a multi-turn rollout's tool responses): those carry no value loss and
                do not count in the token mean (None: every response token counts).

        Returns:
            ``vf_loss`` (the batch's token-mean loss), ``vf_clipfrac``, ``vpred_mean``,
            ``grad_norm``, ``lr``, ``skipped``, ``update_tokens`` and, for a MoE critic, its
            routers' auxiliary losses (``load_balancing_loss``, ``z_loss``: see
            :meth:`~mindspeed_rl.models.actor_update.ActorUpdate._aux_losses`); the same on every rank.
        """
        self.onload()
        with fast_path():
            width = values.shape[-1]
            if returns.shape != values.shape or values.shape[0] != len(pairs):
                raise ValueError(
                    f"values {tuple(values.shape)} and returns {tuple(returns.shape)} do not fit the pairs"
                )
            extra = {"values": values.float(), "returns": returns.float()}
            if loss_mask is not None:
                if loss_mask.shape != values.shape:
                    raise ValueError(f"loss_mask {tuple(loss_mask.shape)} does not fit values {tuple(values.shape)}")
                extra["resp_loss_mask"] = loss_mask.float()  # not "loss_mask": the packed batch has one
            batches = self._microbatches(pairs, width, extra)
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._schedule(batches, self._value_loss, forward_only=False, logits=True)
            lr = float(self.optimizer.param_groups[0]["lr"])
            totals = self._metric_totals(outputs)
            metrics = {name: (sm / n if n else float("nan")) for name, (sm, n) in totals.items()}
            metrics.update(self._aux_losses(len(batches)))  # a MoE critic's routers' (read and cleared)
            outcome = guarded_step(self.optimizer, metrics.get("vf_loss", 0.0), get_accelerator().device())
            if outcome.applied:
                self.scheduler.step(increment=1)
            self.skips.record(outcome.applied, outcome.reason in ("loss", "grad_norm"))
            self.version += 1
        metrics["grad_norm"] = float(outcome.grad_norm) if outcome.grad_norm is not None else float("nan")
        metrics["lr"] = lr
        metrics["skipped"] = 0.0 if outcome.applied else 1.0
        metrics["update_tokens"] = float(sum(len(p) + len(r) for p, r in pairs))
        return metrics
