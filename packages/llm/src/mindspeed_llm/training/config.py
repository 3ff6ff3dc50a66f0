"""Typed configs of ``mindspeed-llm pretrain``: one dataclass per section of a YAML recipe.

``PretrainConfig`` is the single source of truth: a recipe is a YAML mapping of its fields and
``key=value`` overrides use dotted paths (``train.lr=1e-3``); unknown keys are errors with a
suggestion (:func:`mindspeed.config.load_config`). :meth:`PretrainConfig.check` then checks
the values against each other and the world size, and names the key and the fix of anything
that does not fit.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from mindspeed.compile import compile_mode
from mindspeed.config import ConfigError, load_config
from mindspeed.features.manager import FeaturesConfig
from mindspeed.features.pipeline import check_noop_layers
from mindspeed_llm.training.finetune_data import INSTRUCTION_KEYS, PAIRWISE_KEYS
from mindspeed_llm.training.sections import (
    DpoConfig,
    LLMCheckpointConfig,
    LLMEvalConfig,
    LLMLoggingConfig,
    LLMLoraConfig,
    LLMTrainConfig,
    ModelConfig,
    ParallelConfig,
    RmConfig,
    TextDataConfig,
)

#: Names of the sections of a recipe, in the order they are documented.
SECTIONS = ("model", "parallel", "train", "data", "eval", "checkpoint", "logging", "features", "lora", "dpo", "rm")

#: What a recipe trains: the command that runs it (``mindspeed-llm pretrain|sft|dpo|rm``) sets it.
STAGES = ("pretrain", "sft", "dpo", "rm")
#: The stages that read preference pairs.
PAIRWISE_STAGES = ("dpo", "rm")


@dataclass
class PretrainConfig:
    """A pretraining recipe: model, layout, optimisation, data, evaluation, checkpoints, features.

    Attributes:
        model: :class:`ModelConfig`. parallel: :class:`ParallelConfig`. train: :class:`LLMTrainConfig`.
        data: :class:`TextDataConfig`. eval: :class:`LLMEvalConfig`. checkpoint: :class:`LLMCheckpointConfig`.
        logging: :class:`LLMLoggingConfig`. features: ``mindspeed.features.FeaturesConfig``.
        lora: :class:`LLMLoraConfig`. dpo: :class:`DpoConfig`. rm: :class:`RmConfig`. stage: ``pretrain``,
            ``sft``, ``dpo`` or ``rm`` (set by the command).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: LLMTrainConfig = field(default_factory=LLMTrainConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    eval: LLMEvalConfig = field(default_factory=LLMEvalConfig)
    checkpoint: LLMCheckpointConfig = field(default_factory=LLMCheckpointConfig)
    logging: LLMLoggingConfig = field(default_factory=LLMLoggingConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    lora: LLMLoraConfig = field(default_factory=LLMLoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    rm: RmConfig = field(default_factory=RmConfig)
    stage: Literal["pretrain", "sft", "dpo", "rm"] = "pretrain"

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size ``world_size`` leaves over the model-parallel sizes."""
        p = self.parallel
        return world_size // (p.tp * p.pp * p.cp)

    def num_microbatches(self, world_size: int) -> int:
        """Microbatches per step on one data-parallel rank (gradient accumulation)."""
        dp = self.data_parallel_size(world_size)
        return self.global_batch_size(world_size) // (self.train.micro_batch_size * dp)

    def global_batch_size(self, world_size: int) -> int:
        """Sequences per step over all data-parallel ranks."""
        dp = self.data_parallel_size(world_size)
        return self.train.global_batch_size or self.train.micro_batch_size * dp

    def log_dir(self) -> Path | None:
        """Where metrics are written (``logging.dir``, else ``checkpoint.save``)."""
        target = self.logging.dir or self.checkpoint.save
        return Path(target) if target else None

    def _check_lora(self) -> None:
        lora, ck = self.lora, self.checkpoint
        lora.check()
        if not lora.enabled:
            return
        if lora.qlora and not ck.load_hf:
            raise ConfigError("lora.qlora quantises the base weights as they are loaded: start from checkpoint.load_hf")
        if lora.save_peft and not ck.load_hf:
            raise ConfigError("lora.save_peft writes an adapter for a Hugging Face base model: set checkpoint.load_hf")

    def _check_finetune(self) -> None:
        d, p = self.data, self.parallel
        if d.mock:
            raise ConfigError(f"data.mock is for pretraining; {self.stage} needs preprocessed data in data.prefixes")
        if d.weights is not None:
            raise ConfigError(f"data.weights: {self.stage} reads every prefix in full; remove data.weights")
        if d.input is not None:
            if d.prefixes:
                raise ConfigError("give data.input (raw records) or data.prefixes (preprocessed data), not both")
            if not Path(d.input).exists():
                raise ConfigError(f"data.input={d.input!r} does not exist")
            if not d.tokenizer and not self.checkpoint.load_hf:
                raise ConfigError(
                    "data.input is tokenized at the start of the run: set data.tokenizer (or "
                    "checkpoint.load_hf, whose tokenizer is used)"
                )
        else:
            _check_finetune_data(self)
        if d.pad_to_multiple_of < 1:
            raise ConfigError(f"data.pad_to_multiple_of={d.pad_to_multiple_of} must be at least 1")
        if p.sequence_parallel and (
            d.pad_to_multiple_of % p.tp
            if d.variable_seq_lengths
            else (self.train.micro_batch_size * d.seq_length) % p.tp
        ):
            raise ConfigError(
                f"sequence parallelism needs microbatches of a multiple of parallel.tp={p.tp} tokens; "
                "make data.pad_to_multiple_of (with variable_seq_lengths) or data.seq_length a multiple"
            )
        if self.stage == "dpo":
            if self.dpo.beta <= 0:
                raise ConfigError(f"dpo.beta={self.dpo.beta} must be positive")
            if not 0 <= self.dpo.label_smoothing < 0.5:
                raise ConfigError(f"dpo.label_smoothing={self.dpo.label_smoothing} must be in [0, 0.5)")
        coef = self.rm.center_rewards_coefficient
        if self.stage == "rm" and coef is not None and coef < 0:
            raise ConfigError(f"rm.center_rewards_coefficient={coef} must be 0 or more (or null: off)")
        if self.stage == "rm" and p.sequence_parallel:
            raise ConfigError("rm: the score head reads whole sequences; set parallel.sequence_parallel=false")

    def check(self, world_size: int) -> None:
        """Check each section's values, then the sections against each other and ``world_size``.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        self.logging.check()
        _check_positive(self)
        self.eval.check()
        self.train.check()
        self.data.check()
        self.checkpoint.check()
        _check_layout(self, world_size)
        _check_batch(self, world_size)
        _check_data_sources(self)
        _check_eod_reset(self)
        _check_compile(self)
        if self.stage != "pretrain":
            self._check_finetune()
        elif self.data.input is not None:
            raise ConfigError(
                "data.input (raw records tokenized at the start) is for sft and dpo; pretraining reads "
                "preprocessed data.prefixes"
            )
        self._check_lora()
        _check_megatron_fields(self.model.megatron)


def _check_layout(config: PretrainConfig, world_size: int) -> None:
    """The parallel layout against the world size, the model's shape and the sequence length."""
    m, p, d = config.model, config.parallel, config.data
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp x parallel.pp x parallel.cp = "
            f"{model_parallel}; change the layout or the number of processes"
        )
    if p.cp > 1:
        _check_context_parallel(config)
    if p.vpp is not None and p.pp == 1:
        raise ConfigError("parallel.vpp needs pipeline parallelism; set parallel.pp > 1 or unset parallel.vpp")
    if m.num_layers % (p.pp * (p.vpp or 1)):
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by parallel.pp x parallel.vpp = "
            f"{p.pp * (p.vpp or 1)}; change one of them"
        )
    if m.noop_indices():
        try:
            check_noop_layers(m.noop_indices(), m.num_layers, p.pp * (p.vpp or 1))
        except ValueError as error:
            raise ConfigError(f"model.{error}") from error
    _check_heads(config)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1; set parallel.sequence_parallel=false")
    if p.sequence_parallel and d.seq_length % p.tp:
        raise ConfigError(
            f"data.seq_length={d.seq_length} must be divisible by parallel.tp={p.tp} with sequence parallelism"
        )
    _check_experts(config, world_size // model_parallel)
    if p.overlap_param_gather and not p.distributed_optimizer:
        raise ConfigError("parallel.overlap_param_gather needs parallel.distributed_optimizer=true")


def _check_heads(config: PretrainConfig) -> None:
    """Attention heads against query groups, tensor parallelism and the hidden size."""
    m, p = config.model, config.parallel
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_query_groups={groups}"
        )
    if m.num_attention_heads % p.tp or groups % p.tp:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} and model.num_query_groups={groups} "
            f"must be divisible by parallel.tp={p.tp}; lower parallel.tp"
        )
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; set model.kv_channels or change the shape"
        )


def _check_experts(config: PretrainConfig, dp: int) -> None:
    """Expert parallelism against the MoE model and the data-parallel size ``dp``."""
    m, p = config.model, config.parallel
    if p.ep > 1 and not m.num_moe_experts:
        raise ConfigError("parallel.ep > 1 needs an MoE model; set model.num_moe_experts or parallel.ep=1")
    if m.num_moe_experts:
        if m.num_moe_experts % p.ep:
            raise ConfigError(f"model.num_moe_experts={m.num_moe_experts} is not divisible by parallel.ep={p.ep}")
        if (p.tp * dp) % (p.ep * (p.etp or p.tp)):
            raise ConfigError(
                f"parallel.ep x parallel.etp = {p.ep * (p.etp or p.tp)} must divide parallel.tp x "
                f"data-parallel size = {p.tp * dp}"
            )


def _check_batch(config: PretrainConfig, world_size: int) -> None:
    """The global batch against micro batches x data-parallel ranks (and the interleaved schedule)."""
    t, p = config.train, config.parallel
    dp = config.data_parallel_size(world_size)
    micro_dp = t.micro_batch_size * dp
    gbs = config.global_batch_size(world_size)
    if gbs % micro_dp:
        raise ConfigError(
            f"train.global_batch_size={gbs} is not divisible by train.micro_batch_size x "
            f"data-parallel size = {t.micro_batch_size} x {dp}; use a multiple of {micro_dp}"
        )
    if p.vpp is not None and (gbs // micro_dp) % p.pp:
        raise ConfigError(
            f"the interleaved schedule needs the microbatches per step ({gbs // micro_dp}) to be a "
            f"multiple of parallel.pp={p.pp}; raise train.global_batch_size"
        )


def _check_data_sources(config: PretrainConfig) -> None:
    """What the stage reads (prefixes, files, mock data) and where the vocabulary comes from."""
    m, d = config.model, config.data
    if not d.prefixes and not d.mock and not (d.input and config.stage != "pretrain"):
        raise ConfigError(
            "data.prefixes is empty: give the indexed datasets to train on (PREFIX of PREFIX.bin/.idx, "
            "as written by `mindspeed-llm preprocess-data`), or set data.mock=true"
        )
    for prefix in d.prefixes if config.stage == "pretrain" else ():
        missing = [prefix + suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()]
        if missing:
            raise ConfigError(
                f"data.prefixes: {' and '.join(missing)} not found (a prefix names PREFIX.bin and "
                "PREFIX.idx: preprocess-data's --output-prefix followed by _text_document)"
            )
    if m.vocab_size is None and d.tokenizer is None:
        raise ConfigError("model.vocab_size is unset; set it or give data.tokenizer to read it from")
    if (d.reset_position_ids or d.eod_mask_loss) and d.eod_token_id is None and d.tokenizer is None:
        raise ConfigError("data.reset_position_ids / data.eod_mask_loss need data.eod_token_id or data.tokenizer")


def _check_compile(config: PretrainConfig) -> None:
    """``train.compile``: a known mode, on the layouts proven to train as eager (the rest refused in one line)."""
    value = config.train.compile
    try:
        compile_mode(value)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not value:
        return
    p, m = config.parallel, config.model
    # Not proven yet under compiled layers (docs/llm/pretrain.md, "Compiled layers"): refused, not guessed.
    untested = {
        # unpacked (pretrain) microbatches only: the compiled packing gathers the rope table by
        # position within each sequence, which megatron's zig-zag CP split of THD rope does not match.
        "parallel.cp with packed microbatches (sft, dpo, rm)": p.cp > 1 and config.stage != "pretrain",
        # the packed attention op's backward reads the packing of the microbatch that ran forward last:
        # right at pp = 1 (each backward follows its forward), not under 1F1B's interleaving.
        "parallel.pp with packed microbatches (sft, dpo, rm)": p.pp > 1 and config.stage != "pretrain",
        # full: megatron checkpoints whole layers around the compiled forward; selective core_attn:
        # torch.utils.checkpoint inside the graph (mindspeed.megatron.compiled_attention). The other
        # selective modules checkpoint with megatron's RNG-saving CheckpointWithoutOutput, not traced.
        "model.recompute_modules other than core_attn": m.recompute_granularity == "selective"
        and m.recompute_modules is not None
        and set(m.recompute_modules) != {"core_attn"},
    }
    refused = [key for key, on in untested.items() if on]
    if refused:
        raise ConfigError(
            f"train.compile={value} does not compose with {', '.join(refused)} yet; set train.compile=false"
        )


def _check_eod_reset(config: PretrainConfig) -> None:
    """``data.reset_attention_mask`` / ``data.reset_position_ids`` against the stage, the model and the layout."""
    d, p = config.data, config.parallel
    if d.reset_attention_mask and d.eod_token_id is None and d.tokenizer is None:
        raise ConfigError("data.reset_attention_mask needs data.eod_token_id or data.tokenizer")
    if d.reset_attention_mask and config.stage != "pretrain":
        raise ConfigError(
            f"data.reset_attention_mask is for pretraining; {config.stage} already keeps samples apart: remove it"
        )
    rope = config.model.position_embedding_type == "rope"
    if rope and d.reset_attention_mask != d.reset_position_ids:
        raise ConfigError(
            "with rotary embeddings data.reset_attention_mask and data.reset_position_ids go together "
            "(each document is its own packed sequence, so its rotary positions restart at 0): set both"
        )
    if d.reset_attention_mask and p.cp > 1 and p.pp > 1:
        raise ConfigError(
            "data.reset_attention_mask under parallel.cp > 1 pads every document to a multiple of "
            "2 x cp, so microbatches change length, which parallel.pp > 1 cannot take; use pp=1"
        )


def _check_context_parallel(config: PretrainConfig) -> None:
    """What ``parallel.cp > 1`` needs of the rest of the recipe."""
    p, d = config.parallel, config.data
    if config.stage in PAIRWISE_STAGES:
        raise ConfigError(f"{config.stage} does not support parallel.cp > 1 yet; set parallel.cp=1")
    if d.seq_length % (2 * p.cp):
        raise ConfigError(
            f"data.seq_length={d.seq_length} must be divisible by 2 x parallel.cp = {2 * p.cp} "
            "(each rank holds two of 2 x cp chunks of every sequence); change one of them"
        )
    if p.sequence_parallel and (d.seq_length // p.cp) % p.tp:
        raise ConfigError(
            f"data.seq_length / parallel.cp = {d.seq_length // p.cp} must be divisible by parallel.tp="
            f"{p.tp} with sequence parallelism; change data.seq_length"
        )
    if config.stage != "pretrain" and p.pp > 1 and not d.variable_seq_lengths:
        raise ConfigError(
            "packed sequences under parallel.cp > 1 are padded to multiples of 2 x cp, so microbatches "
            "change length: with parallel.pp > 1 set data.variable_seq_lengths=true"
        )


def _check_positive(config: PretrainConfig) -> None:
    names = {
        "model": ("num_layers", "hidden_size", "num_attention_heads", "make_vocab_size_divisible_by"),
        "parallel": ("tp", "pp", "ep", "cp"),
    }
    for section, keys in names.items():
        for key in keys:
            value = getattr(getattr(config, section), key)
            if value < 1:
                raise ConfigError(f"{section}.{key}={value} must be at least 1")
    for key, value in (("parallel.vpp", config.parallel.vpp), ("model.vocab_size", config.model.vocab_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1 (or unset)")


def _check_finetune_data(config: PretrainConfig) -> None:
    keys = PAIRWISE_KEYS if config.stage in PAIRWISE_STAGES else INSTRUCTION_KEYS
    kind = (
        "pairwise (AlpacaStylePairwiseHandler ...)"
        if config.stage in PAIRWISE_STAGES
        else "instruction (AlpacaStyleInstructionHandler ...)"
    )
    for prefix in config.data.prefixes:
        path = f"{prefix}_packed_{keys[0]}_document"
        if not (Path(path + ".bin").is_file() and Path(path + ".idx").is_file()):
            raise ConfigError(
                f"data.prefixes: {path}.bin/.idx not found; {config.stage} reads {kind} data: give the "
                "--output-prefix preprocess-data wrote it with"
            )


def _check_megatron_fields(extra: dict[str, Any]) -> None:
    if not extra:
        return
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    # multi_latent_attention: the fields of megatron's MLATransformerConfig are known too.
    known = [f.name for f in fields(MLATransformerConfig if extra.get("multi_latent_attention") else TransformerConfig)]
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"model.megatron.{key} is not a megatron TransformerConfig field{hint}")


def load_pretrain_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PretrainConfig:
    """Read a recipe and apply ``key=value`` overrides (strict: unknown keys are errors).

    Args:
        path: YAML recipe (``None``: defaults only).
        overrides: dotted ``key=value`` strings, e.g. ``["train.steps=10", "parallel.tp=2"]``.

    Raises:
        ConfigError: naming the key and suggesting the closest known one.
    """
    return load_config(PretrainConfig, path, overrides)
