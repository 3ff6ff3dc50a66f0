"""PPO's critic: a megatron-core GPT whose output layer is a scalar value head.

The critic is built like the actor (:func:`mindspeed_llm.engine.build_engine`: the model, its own
optimizer and schedule, any TP/PP layout), and its ``prepare`` step turns the fresh chunks into a
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import SkipCounter
from mindspeed.device import get_accelerator
from mindspeed.features import FeaturesConfig
from mindspeed.log import get_logger
from mindspeed.megatron import fast_path
from mindspeed_llm.engine import (
    BuildSpec,
    CheckpointConfig,
    ParallelConfig,
    PretrainConfig,
    build_engine,
    build_transformer_config,
    guarded_step,
    hf_model_shape,
    load_model_checkpoint,
    padded_vocab_size,
    read_hf_shape,
)
from mindspeed_rl.algorithms.value_loss import ValueLossInputs, compute_value_loss
from mindspeed_rl.models.actor import Actor, ActorSettings, _ensure_megatron
from mindspeed_rl.models.actor_packing import Pair, resolve_share_prompt
from mindspeed_rl.models.critic_init import init_value_model, read_critic_source
from mindspeed_rl.models.memory import StorageOffloader

logger = get_logger(__name__)

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

    Shares the actor's packing, schedule, pipeline broadcast and co-location memory; its own
    optimizer and schedule come from ``settings``.

    Args:
        hf_dir: a ``*ForSequenceClassification`` (num_labels 1) or ``*ForCausalLM`` directory.
        settings: optimizer, schedule, batching and value-loss settings.
        tp, pp: the layout.
        features: as the actor's (the same in one process).

    Raises:
        ConfigError: an unreadable directory, a classifier with more than one label.
    """

    def __init__(
        self,
        hf_dir: str,
        settings: CriticSettings | None = None,
        tp: int = 1,
        pp: int = 1,
        features: FeaturesConfig | None = None,
    ) -> None:
        self.settings = s = settings or CriticSettings()
        self.hf_dir, self.trainable = str(hf_dir), True
        # build_engine refuses the dualpipev feature here (the value head is not placed on the V's end).
        self.dualpipev = False
        self.parallel = parallel = ParallelConfig(tp=tp, pp=pp)
        self.config = PretrainConfig(stage="sft", parallel=parallel, checkpoint=CheckpointConfig(load_hf=self.hf_dir))
        source = read_critic_source(self.hf_dir)
        shape = hf_model_shape(self.hf_dir, s.precision)
        self.hf_vocab = shape.vocab_size
        self.vocab = padded_vocab_size(shape.vocab_size, 1, tp)
        self.adaptation, self._adapted, self.groups = _ensure_megatron(
            shape, parallel, s.seed, features or FeaturesConfig(), dist.get_world_size()
        )
        prepare = partial(
            init_value_model,
            source=source,
            parallel=parallel,
            vocab_rows=self.vocab,
            groups=self.groups,
            std=s.head_std,
            seed=s.seed,
        )
        spec = BuildSpec(
            shape=shape,
            parallel=parallel,
            vocab=self.vocab,
            transformer=partial(build_transformer_config, shape, parallel, per_token_loss=True),
            optimizer=s.optimizer,
            scheduler=s.scheduler,
            scheduler_steps=s.scheduler.lr_warmup_steps + 1,
            prepare=prepare,
            bridged=True,
        )
        built = build_engine(spec, self.adaptation, self.groups)
        self.transformer, self.chunks = built.transformer, built.chunks
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self.bridge, self.shape, _ = read_hf_shape(self.hf_dir)
        self.share_prompt = resolve_share_prompt(s.share_prompt, pp, shape, self.chunks)
        self.version = 0
        self.skips = SkipCounter(s.max_nonfinite_steps, lr_key="critic.lr", unit="critic update")
        acc = get_accelerator()
        self._offloader = StorageOffloader(acc.device(), pin=acc.supports("pinned_memory"))
        logger.info("critic from %s (%s head): %s, tp=%d pp=%d", self.hf_dir, source.kind, self.bridge.family, tp, pp)

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
            ``grad_norm``, ``lr``, ``skipped``; the same on every rank.
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
