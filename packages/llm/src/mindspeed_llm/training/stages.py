"""What each training stage brings to the one loop: its data, its microbatches and its loss.

``pretrain`` reads megatron-core's GPT datasets (documents concatenated into fixed-length
samples) and trains the language-model loss on every token; ``sft`` reads instruction data
as packed THD microbatches and trains the same loss on the response tokens only; ``dpo``
reads preference pairs and trains a DPO loss against a frozen reference model, whose
log-probabilities are computed over the same microbatches before each step; ``rm`` reads
the same pairs and trains a reward model (a scalar score head in the place of the output
layer) with the Bradley-Terry loss. Stages are registered by name in :data:`STAGES`.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed.config import ConfigError
from mindspeed.log import get_logger
from mindspeed.registry import Registry
from mindspeed_llm.data.preprocess import PreprocessConfig, preprocess_data
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.data import DocumentResetReader, MicrobatchReader, build_datasets, token_limit
from mindspeed_llm.training.dpo import DPO_LOSS, dpo_loss_func, reference_logps
from mindspeed_llm.training.finetune_data import (
    INSTRUCTION_KEYS,
    PAIRWISE_KEYS,
    DocumentDataset,
    PackedMicrobatchReader,
    PackSettings,
    check_finetune_data,
)
from mindspeed_llm.training.reward import RM_LOSS, attach_score_head, rm_loss_func
from mindspeed_llm.training.steps import LM_LOSS, LossFunc, lm_loss

logger = get_logger(__name__)


class Stage:
    """A training stage (subclasses set the class attributes and the methods).

    Attributes:
        name: the stage (``PretrainConfig.stage``).
        metric: the metric reported as ``loss``.
        needs_reference: builds a frozen reference model (DPO).
        fresh_params: megatron names that keep their initialisation when the Hugging Face
            directory the run starts from has none of their shape (the reward model's head).
    """

    name = ""
    metric = LM_LOSS
    needs_reference = False
    fresh_params: tuple[str, ...] = ()

    def datasets(self, config: PretrainConfig, world_size: int, ids: Any) -> tuple[Any, Any]:
        """``(train, validation or None)``; collective."""
        raise NotImplementedError

    def reader(
        self, dataset: Any, config: PretrainConfig, dp_rank: int, dp_size: int, device: torch.device, pad_id: int
    ) -> Any:
        """A reader with ``step(consumed, num_microbatches) -> microbatches``; ``pad_id`` is the end-of-document token."""
        raise NotImplementedError

    def loss_fn(self, config: PretrainConfig, transform: Any = None) -> LossFunc:
        """The loss of one microbatch."""
        return lm_loss(transform)

    def prepare(
        self, reference: list[Any] | None, batches: list[dict[str, Any]], groups: Any = None, dualpipev: bool = False
    ) -> None:
        """Work on a step's microbatches before the training pass (collective; ``groups``: the process
        groups, ``dualpipev``: the chunks are DualPipeV's V)."""

    def adapt_model(self, models: list[Any], config: PretrainConfig) -> None:
        """Change this rank's bare model chunks before their weights are loaded (and before LoRA and DDP)."""


#: stage name -> :class:`Stage` subclass.
STAGES: Registry[type[Stage]] = Registry("training stage")


@STAGES.register("pretrain")
class PretrainStage(Stage):
    """Megatron GPT datasets and the language-model loss on every token."""

    name = "pretrain"

    def datasets(self, config: PretrainConfig, world_size: int, ids: Any) -> tuple[Any, Any]:
        return build_datasets(config, world_size, ids)

    def reader(
        self, dataset: Any, config: PretrainConfig, dp_rank: int, dp_size: int, device: torch.device, pad_id: int
    ) -> Any:
        reader = MicrobatchReader(dataset, config.train.micro_batch_size, dp_rank, dp_size, device)
        if config.data.reset_attention_mask:
            cp = config.parallel.cp
            return DocumentResetReader(reader, pad_id, segment_multiple=2 * cp if cp > 1 else 1)
        return reader


class _FinetuneStage(Stage):
    pairwise = False

    def datasets(self, config: PretrainConfig, world_size: int, ids: Any) -> tuple[Any, Any]:
        keys = PAIRWISE_KEYS if self.pairwise else INSTRUCTION_KEYS
        d = config.data
        prefixes = [self._tokenize_input(config)] if d.input else list(d.prefixes)
        check_finetune_data(prefixes, keys, token_limit(config, ids))
        train = DocumentDataset(prefixes, keys, d.split, 0, config.train.seed, shuffle=True)
        if not len(train):
            raise ConfigError(f"data.split={d.split!r} leaves no training samples in {prefixes}")
        evaluates = config.eval.interval is not None or config.eval.at_end
        valid = DocumentDataset(prefixes, keys, d.split, 1, config.train.seed, shuffle=False) if evaluates else None
        if valid is not None and not len(valid):
            raise ConfigError(
                f"evaluation needs validation samples but data.split={d.split!r} leaves none; give the "
                "split a valid part (e.g. '95,5,0') or unset eval.interval/eval.at_end"
            )
        logger.info(
            "data: %d %s for training%s",
            len(train),
            "pairs" if self.pairwise else "samples",
            f", {len(valid)} for validation" if valid is not None else "",
        )
        return train, valid

    def _tokenize_input(self, config: PretrainConfig) -> str:
        """Run ``data.input`` through preprocess-data's handler once (rank 0; cached); returns the prefix."""
        import hashlib
        import json
        import tempfile
        from pathlib import Path

        import torch.distributed as dist

        d = config.data
        source = Path(d.input)
        stamp = [
            (str(p), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted([source, *source.rglob("*")])
            if p.is_file()
        ]
        handler = d.handler_name or ("AlpacaStylePairwiseHandler" if self.pairwise else "AlpacaStyleInstructionHandler")
        tokenizer = d.tokenizer or config.checkpoint.load_hf
        settings = dict(
            files=stamp,
            tokenizer=str(tokenizer),
            handler=handler,
            prompt_type=d.prompt_type,
            map_keys=d.map_keys,
            seq_length=d.seq_length,
            pack=not self.pairwise,
        )
        key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
        root = (
            Path(d.cache_dir)
            if d.cache_dir
            else (
                Path(config.checkpoint.save) / "data"
                if config.checkpoint.save
                else Path(tempfile.gettempdir()) / "mindspeed-finetune-data"
            )
        )
        prefix = root / f"{source.stem}-{key}"
        marker = Path(f"{prefix}.done")
        if dist.get_rank() == 0 and not marker.is_file():
            root.mkdir(parents=True, exist_ok=True)
            try:
                report = preprocess_data(
                    PreprocessConfig(
                        input=str(source),
                        tokenizer_name_or_path=str(tokenizer),
                        output_prefix=str(prefix),
                        handler_name=handler,
                        seq_length=d.seq_length,
                        pack=not self.pairwise,
                        prompt_type=d.prompt_type,
                        map_keys=d.map_keys,
                    )
                )
            except ValueError as err:
                raise ConfigError(f"data.input: {err}") from err
            marker.write_text(json.dumps(settings, default=str))
            logger.info("data.input: %s", report.describe())
        dist.barrier()
        return str(prefix)

    def reader(
        self, dataset: Any, config: PretrainConfig, dp_rank: int, dp_size: int, device: torch.device, pad_id: int
    ) -> Any:
        d = config.data
        cp = config.parallel.cp
        settings = PackSettings(
            d.seq_length,
            config.train.micro_batch_size,
            d.variable_seq_lengths,
            d.pad_to_multiple_of,
            pad_id,
            segment_multiple=2 * cp if cp > 1 else 1,
        )
        return PackedMicrobatchReader(dataset, settings, self.pairwise, dp_rank, dp_size, device)


@STAGES.register("sft")
class SftStage(_FinetuneStage):
    """Instruction data in packed microbatches; the loss on response tokens only."""

    name = "sft"


@STAGES.register("dpo")
class DpoStage(_FinetuneStage):
    """Preference pairs; the DPO loss against a frozen reference model."""

    name = "dpo"
    pairwise = True
    needs_reference = True

    @property
    def metric(self) -> str:  # type: ignore[override]
        return DPO_LOSS

    def loss_fn(self, config: PretrainConfig, transform: Any = None) -> LossFunc:
        if transform is not None:
            raise ValueError("loss transforms apply to the language-model loss, not to dpo")
        return dpo_loss_func(config.dpo.beta, config.dpo.label_smoothing, config.dpo.loss_type)

    def prepare(
        self, reference: list[Any] | None, batches: list[dict[str, Any]], groups: Any = None, dualpipev: bool = False
    ) -> None:
        reference_logps(reference, batches, groups, dualpipev)


@STAGES.register("rm")
class RewardModelStage(_FinetuneStage):
    """Preference pairs; a scalar score head and the Bradley-Terry loss (an outcome reward model)."""

    name = "rm"
    pairwise = True
    fresh_params = ("output_layer.weight",)

    @property
    def metric(self) -> str:  # type: ignore[override]
        return RM_LOSS

    def loss_fn(self, config: PretrainConfig, transform: Any = None) -> LossFunc:
        if transform is not None:
            raise ValueError("loss transforms apply to the language-model loss, not to rm")
        return rm_loss_func(config.rm.margin, config.rm.center_rewards_coefficient)

    def adapt_model(self, models: list[Any], config: PretrainConfig) -> None:
        attach_score_head(models, config.model.init_method_std, config.train.seed)


def get_stage(name: str) -> Stage:
    """The stage ``name`` (an instance)."""
    return STAGES.get(name)()
