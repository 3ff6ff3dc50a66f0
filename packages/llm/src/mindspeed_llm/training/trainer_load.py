"""How the LLM :class:`~mindspeed_llm.training.trainer.Trainer` starts from weights: Hugging Face
base weights and LoRA on the bare chunks, a Megatron checkpoint (resumed or ``checkpoint.load``)
and DPO's reference model.

:class:`TrainerLoading` is a part of the ``Trainer``: it reads the trainer's ``config``,
``chunks``, ``optimizer``, ``scheduler``, ``stage``, ``vocab``, ``groups``, ``reference`` and
``checkpoint_args`` and sets ``saved_step``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mindspeed.checkpointing import find_resume, holds_checkpoints
from mindspeed.config import ConfigError
from mindspeed.log import get_logger
from mindspeed_llm.training.build import uses_dualpipev
from mindspeed_llm.training.checkpoint import TrainState, find_checkpoint, load_checkpoint
from mindspeed_llm.training.hf import load_hf_weights
from mindspeed_llm.training.lora import LoraSettings, apply_lora
from mindspeed_llm.training.qlora import apply_qlora

logger = get_logger("mindspeed_llm.training.trainer")


class TrainerLoading:
    """The trainer's start: weights before wrapping, the checkpoint to resume, the DPO reference."""

    config: Any
    chunks: list[Any]
    optimizer: Any
    scheduler: Any
    stage: Any
    vocab: int
    groups: Any
    reference: list[Any] | None
    checkpoint_args: Any
    saved_step: int | None

    def _load(self) -> TrainState:
        ck = self.config.checkpoint
        rank0 = dist.get_rank() == 0
        family = getattr(self.checkpoint_args, "model_type_hf", None)
        if ck.save and ck.resume:
            # The newest complete checkpoint of this run wins over checkpoint.load (where it started).
            found = find_resume(ck.save, warn=rank0)
            if found.path is not None:
                self.saved_step = found.step
                return load_checkpoint(
                    found.path, self.chunks, self.optimizer, self.scheduler, self.config, family=family
                )
            if holds_checkpoints(ck.save):
                damaged = "; ".join(f"{path.name}: {why}" for path, why in found.skipped) or "no iter_* directory"
                raise ConfigError(
                    f"checkpoint.save={ck.save!r} holds checkpoints but none is complete ({damaged}); "
                    "set checkpoint.resume=false to train from step 1 there (its checkpoints are "
                    "replaced as the run saves) or set checkpoint.save to a new directory"
                )
        elif ck.save and holds_checkpoints(ck.save) and rank0:
            logger.warning(
                "checkpoint.resume=false: training from step 1; the checkpoints in %s are replaced as this run saves",
                ck.save,
            )
        if ck.load:
            source = find_checkpoint(ck.load)
            state = load_checkpoint(
                source,
                self.chunks,
                self.optimizer,
                self.scheduler,
                self.config,
                weights_only=ck.finetune,
                family=family,
            )
            if ck.finetune or not ck.load_optimizer:
                self._refresh_master_weights()
            return state
        return TrainState()

    def _prepare(self, models: list[Any]) -> None:
        """Base weights and LoRA on the bare chunks, before DDP wraps them and the optimizer sees them."""
        ck, lora = self.config.checkpoint, self.config.lora
        # From Hugging Face weights unless a Megatron checkpoint is named; a resumed run reads
        # them too (QLoRA's quantised base is not in its checkpoints) and then the checkpoint.
        self.stage.adapt_model(models, self.config)
        if ck.load_hf and not ck.load:
            load_hf_weights(
                models,
                ck.load_hf,
                self.config.parallel,
                self.vocab,
                self.groups,
                self.config.model.noop_indices(),
                keep=self.stage.fresh_params,
                dualpipev=uses_dualpipev(self.report),
            )
        if lora.enabled:
            settings = self.lora_settings()
            for model in models:
                (apply_qlora if settings.qlora else apply_lora)(model, settings)

    def lora_settings(self) -> Any:
        """The :class:`~mindspeed_llm.training.lora.LoraSettings` of the recipe."""
        lora = self.config.lora
        return LoraSettings(
            r=lora.r,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=tuple(lora.target_modules),
            qlora=lora.qlora,
            qlora_all_linears=lora.qlora_all_linears,
            seed=self.config.train.seed,
        )

    def _refresh_master_weights(self) -> None:
        # Megatron's mixed-precision optimizers keep fp32 master copies of the weights they were
        # built with: weights loaded afterwards (without optimizer state) must reach them too.
        self.optimizer.reload_model_params()

    def _load_reference(self) -> None:
        """The DPO reference: ``dpo.ref_model``, else the weights the policy started from."""
        ck, source = self.config.checkpoint, self.config.dpo.ref_model
        if source is None and not (ck.load_hf or ck.load):
            raise ConfigError(
                "dpo needs the model to start from: set checkpoint.load_hf or checkpoint.load "
                "(or dpo.ref_model for the reference)"
            )
        if source is None:
            source = ck.load_hf or ck.load
            hf = bool(ck.load_hf) and not ck.load
        else:
            from pathlib import Path

            hf = (Path(source) / "config.json").is_file()
        if hf:
            load_hf_weights(
                self.reference,
                source,
                self.config.parallel,
                self.vocab,
                self.groups,
                self.config.model.noop_indices(),
                dualpipev=uses_dualpipev(self.report),
            )
            return
        found = find_checkpoint(source, what="dpo.ref_model")
        load_checkpoint(found, self.reference, None, None, self.config, weights_only=True)
