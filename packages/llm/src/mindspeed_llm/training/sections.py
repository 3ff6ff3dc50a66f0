"""The sections of an LLM recipe (``model``, ``parallel``, ``train``, ``data``, ``eval``,
``checkpoint``, ``lora``, ``dpo``, ``logging``): one dataclass each, with their defaults and the
derived values they compute. ``train``, ``checkpoint`` and ``logging`` extend the core's sections
(:mod:`mindspeed.training_config`, :mod:`mindspeed.checkpointing.config`,
:mod:`mindspeed.metrics.config`) with the LLM suite's keys; each section checks its own values.
:class:`~mindspeed_llm.training.config.PretrainConfig` holds them and checks them against each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from mindspeed.checkpointing.config import CheckpointConfig as CoreCheckpointConfig
from mindspeed.config import ConfigError, recipe_section
from mindspeed.features.pipeline import parse_noop_layers
from mindspeed.lora_config import LoraConfig as CoreLoraConfig
from mindspeed.metrics.config import LossCurveLoggingConfig
from mindspeed.model.shape import ModelShape
from mindspeed.training_config import EvalConfig, OptimizerTrainConfig
from mindspeed_llm.training.lora import LORA_TARGETS, LoraSettings


@dataclass
class ModelConfig:
    """Shape of the GPT (Llama-like by default: RMSNorm, SwiGLU, rope, no biases).

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width.
        ffn_hidden_size: MLP width (default ``4 * hidden_size``).
        num_attention_heads: query heads.
        num_query_groups: key/value heads for grouped-query attention (default: as many as heads).
        kv_channels: head dimension (default ``hidden_size // num_attention_heads``).
        vocab_size: tokenizer vocabulary (default: read from ``data.tokenizer``).
        make_vocab_size_divisible_by: the embedding is padded to a multiple of this and of the
            tensor-parallel size (the least common multiple, so every layout pads alike).
        normalization: ``RMSNorm`` or ``LayerNorm``.
        norm_epsilon: epsilon of the norms.
        swiglu: gated SiLU MLP (Llama); false: a plain GeLU MLP.
        position_embedding_type: ``rope``, ``learned_absolute``, ``alibi`` (MindSpeed's
            ``--position-embedding-type alibi``: the ``alibi`` feature) or ``none``.
        rotary_base: rope base frequency.
        rope_scaling: Llama 3.1's rope frequency scaling.
        rope_scaling_factor: its factor.
        max_position_embeddings: positions of a learned embedding (default ``data.seq_length``).
        tie_embeddings: share the input embedding with the output layer.
        add_bias_linear: biases in all linear layers.
        add_qkv_bias: biases in the query/key/value projection only (Qwen2).
        qk_layernorm: normalise queries and keys (Qwen3).
        hidden_dropout: dropout after attention and MLP.
        init_method_std: standard deviation of the normal weight initialisation.
        num_moe_experts: experts per MoE layer (default: dense MLPs).
        moe_router_topk: experts per token.
        moe_ffn_hidden_size: expert MLP width (default ``ffn_hidden_size``).
        moe_aux_loss_coeff: load-balancing loss coefficient.
        moe_token_dispatcher_type: ``alltoall`` or ``allgather``.
        recompute_granularity: ``full`` or ``selective`` activation recomputation (default none).
        recompute_method: with ``full``: ``uniform`` (every layer, in blocks of
            ``recompute_num_layers``) or ``block`` (the first ``recompute_num_layers`` layers of
            each pipeline stage).
        recompute_num_layers: with ``full``: layers per recomputed block (``uniform``) or
            recomputed layers per stage (``block``).
        recompute_modules: with ``selective``: megatron's submodules to recompute (``core_attn``,
            ``mlp``, ``moe``, ``moe_act``, ``layernorm``, ``mla_up_proj``, ``shared_experts``;
            default megatron's, ``["core_attn"]``; megatron-core 0.16's ``layernorm`` needs Transformer
            Engine: use the ``recompute_norm`` feature instead).
        noop_layers: MindSpeed's ``--noop-layers``: indices (``"0,5"`` or a list) of layers among
            ``num_layers`` that are identities; they balance pipeline stages and hold no
            weights (the model has ``num_layers - len(noop_layers)`` layers, placed by megatron's
            ``pipeline_model_parallel_layout``).
        megatron: more ``TransformerConfig`` fields, passed through as they are.
    """

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    kv_channels: int | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    position_embedding_type: Literal["rope", "learned_absolute", "alibi", "none"] = "rope"
    rotary_base: float = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    max_position_embeddings: int | None = None
    tie_embeddings: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: list[str] | None = None
    noop_layers: str | list[int] | None = None
    megatron: dict[str, Any] = field(default_factory=dict)

    def to_shape(self, vocab_size: int, seq_length: int, precision: str = "fp32") -> ModelShape:
        """The :class:`~mindspeed.model.ModelShape` this section writes (defaults resolved).

        Args:
            vocab_size: the vocabulary (the tokenizer's, or this section's ``vocab_size``).
            seq_length: ``data.seq_length`` (the default of ``max_position_embeddings``).
            precision: ``train.precision`` (the weights' dtype).
        """
        values = {shape: getattr(self, mine) for mine, shape in SHAPE_FIELDS.items()}
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        values.update(
            num_layers=self.num_layers - len(self.noop_indices()),
            ffn_hidden_size=ffn,
            vocab_size=vocab_size,
            max_position_embeddings=self.max_position_embeddings or seq_length,
            untie_embeddings_and_output_weights=not self.tie_embeddings,
            params_dtype="bfloat16" if precision == "bf16" else "float32",
            moe_ffn_hidden_size=(self.moe_ffn_hidden_size or ffn) if self.num_moe_experts else None,
            moe_router_pre_softmax=bool(self.megatron.get("moe_router_pre_softmax", False)),
        )
        return ModelShape(**values)

    def noop_indices(self) -> tuple[int, ...]:
        """The sorted indices of ``noop_layers`` (empty: none)."""
        try:
            return parse_noop_layers(self.noop_layers)
        except ValueError as error:
            raise ConfigError(f"model.{error}") from error

    @classmethod
    def shape_values(cls, shape: ModelShape) -> dict[str, Any]:
        """The fields of this section that ``shape`` decides (the inverse of :meth:`to_shape`)."""
        values = {mine: getattr(shape, theirs) for mine, theirs in SHAPE_FIELDS.items()}
        values["tie_embeddings"] = shape.tie_embeddings
        return values


#: ModelConfig field -> ModelShape field, for the fields that carry over one to one (the one
#: table between the recipe's ``model`` section and the model description).
SHAPE_FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "vocab_size": "vocab_size",
    "norm_epsilon": "norm_epsilon",
    "rotary_base": "rotary_base",
    "rope_scaling": "use_rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
    "add_qkv_bias": "add_qkv_bias",
    "qk_layernorm": "qk_layernorm",
    "num_moe_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk",
    "normalization": "normalization",
    "swiglu": "swiglu",
    "add_bias_linear": "add_bias_linear",
    "position_embedding_type": "position_embedding_type",
}


@dataclass
class ParallelConfig:
    """The parallel layout; the data-parallel size is what the world size leaves over.

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        vpp: virtual pipeline stages per pipeline rank (interleaved 1F1B; default none).
        ep: expert-parallel size.
        etp: expert tensor-parallel size (default: megatron's, the tensor-parallel size).
        cp: context-parallel size: every sequence is split over ``cp`` ranks (zig-zag); the
            algorithm is ``features.settings.context_parallel.context_parallel_algo``
            (``megatron_cp_algo``, the ring, by default). See docs/llm/long-sequence.md.
        sequence_parallel: shard activations along the sequence inside tensor-parallel regions.
        distributed_optimizer: shard optimizer state and master weights over data-parallel ranks.
        overlap_grad_reduce: reduce gradient buckets while the backward runs.
        overlap_param_gather: gather distributed-optimizer parameters in the next forward.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False


@recipe_section(
    name="TrainConfig",
    keys=(
        "steps",
        "micro_batch_size",
        "global_batch_size",
        "seed",
        "precision",
        "optimizer",
        "lr",
        "min_lr",
        "lr_warmup_init",
        "lr_warmup_steps",
        "lr_decay_style",
        "lr_decay_steps",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "sgd_momentum",
        "clip_grad",
        "max_nonfinite_steps",
        "exit_duration_mins",
        "compile",
        "deterministic",
    ),
)
@dataclass
class LLMTrainConfig(OptimizerTrainConfig):
    """The core's ``train`` section (:class:`mindspeed.training_config.OptimizerTrainConfig`: steps, seed,
    micro batch, precision, AdamW and its schedule, clipping, the stops, ``deterministic``) plus
    megatron's global batch, SGD and the schedule's start and length.

    ``micro_batch_size`` is sequences per microbatch on one data-parallel rank; ``deterministic``
    also sets megatron's ``deterministic_mode``; ``max_nonfinite_steps`` skips a step before the
    optimizer applies it (megatron's ``check_for_nan_in_loss_and_grad`` raises instead).

    Attributes:
        global_batch_size: sequences per step over all ranks (default ``micro_batch_size`` x
            data-parallel size); gradients are accumulated over
            ``global / (micro x data-parallel)`` microbatches.
        optimizer: ``adam`` (AdamW: decoupled weight decay) or ``sgd``.
        lr_warmup_init: learning rate at step 0 of the warmup.
        lr_decay_steps: steps from 0 to the end of the decay (default ``steps``).
        sgd_momentum: SGD momentum.
        compile: regional compilation (:mod:`mindspeed_llm.training.compile`): ``torch.compile`` of
            each megatron ``TransformerLayer``'s forward (``fullgraph``, static shapes), torchtitan's
            way: ``true`` (or ``default``), ``max-autotune``; ``false``: eager. It pays once the steps
            outlast the compile (seconds a layer class on a CPU, logged and in ``docs/llm/pretrain.md``).
    """

    global_batch_size: int | None = None
    optimizer: Literal["adam", "sgd"] = "adam"
    lr_warmup_init: float = 0.0
    lr_decay_steps: int | None = None
    sgd_momentum: float = 0.9
    compile: bool | Literal["default", "max-autotune"] = False

    NON_NEGATIVE = ("min_lr", "lr_warmup_init", "weight_decay", "adam_eps", "sgd_momentum", "clip_grad")

    def check(self) -> None:
        """A positive learning rate, the core's checks, the global batch and the schedule's warmup against its decay.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be positive; give a learning rate such as train.lr=3e-4")
        super().check()
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} must be at least 1 (or unset)")

    def check_schedule(self) -> None:
        """Warmup start and final learning rate below the peak, the warmup before the end of the decay."""
        if self.lr < self.min_lr or self.lr_warmup_init > self.lr:
            raise ConfigError(
                f"need train.lr_warmup_init <= train.lr and train.min_lr <= train.lr "
                f"(got {self.lr_warmup_init}, {self.min_lr}, {self.lr})"
            )
        decay = self.lr_decay_steps or self.steps
        if self.steps and self.lr_warmup_steps and self.lr_warmup_steps >= decay:
            raise ConfigError(
                f"train.lr_warmup_steps={self.lr_warmup_steps} must be below train.lr_decay_steps "
                f"(default train.steps) = {decay}"
            )

    def optimizer_config(self) -> OptimizerConfig:
        """The optimizer section of these settings."""
        return _section(OptimizerConfig, self)

    def scheduler_config(self) -> SchedulerConfig:
        """The learning-rate schedule section of these settings."""
        return _section(SchedulerConfig, self)


@dataclass
class OptimizerConfig:
    """The optimizer section: what :func:`mindspeed_llm.training.optim.build_optimizer` takes.

    A recipe's ``train`` section carries these fields (:meth:`LLMTrainConfig.optimizer_config`);
    other users (the RL actor) fill the section directly.

    Attributes:
        optimizer: ``adam`` (AdamW: decoupled weight decay) or ``sgd``.
        lr: peak learning rate (the scheduler moves it).
        min_lr: learning rate at the end of the decay.
        weight_decay: AdamW weight decay.
        adam_beta1: Adam beta1.
        adam_beta2: Adam beta2.
        adam_eps: Adam epsilon.
        sgd_momentum: SGD momentum.
        clip_grad: clip the global gradient norm to this (0: no clipping).
        kernel: the AdamW step's registry kernel: ``auto``, ``fused`` or ``foreach`` (default: the features'
            ``fused_adamw`` feature's choice, else megatron's per-tensor loop).
    """

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    kernel: str | None = None


@dataclass
class SchedulerConfig:
    """The learning-rate schedule section: what :func:`mindspeed_llm.training.optim.build_scheduler` takes.

    Attributes:
        lr: peak learning rate.
        min_lr: learning rate at the end of the decay.
        lr_warmup_init: learning rate at step 0 of the warmup.
        lr_warmup_steps: linear warmup steps.
        lr_decay_style: ``cosine``, ``linear``, ``constant`` or ``inverse-square-root`` after the warmup.
        lr_decay_steps: steps from 0 to the end of the decay (default: the run's step count).
        weight_decay: weight decay (constant over the run).
    """

    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["cosine", "linear", "constant", "inverse-square-root"] = "cosine"
    lr_decay_steps: int | None = None
    weight_decay: float = 0.01


def _section(cls: type, source: Any) -> Any:
    # The fields of section ``cls`` that ``source`` has under the same names.
    return cls(**{f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)})


@recipe_section(name="DataConfig")
@dataclass
class TextDataConfig:
    """The ``data`` section of an LLM recipe: megatron indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``), blended and split.

    Attributes:
        prefixes: dataset prefixes (the path without ``.bin``/``.idx``), e.g.
            ``data/wiki_text_document``.
        weights: blending weights, one per prefix (default: proportional to their sizes).
        split: train,valid,test weights of every dataset's documents, e.g. ``969,30,1``.
        seq_length: tokens per sequence.
        tokenizer: a local Hugging Face tokenizer directory, or ``demo``: gives
            ``model.vocab_size`` and the end-of-document token when they are not set.
        eod_token_id: end-of-document token (for ``reset_attention_mask`` / ``reset_position_ids`` /
            ``eod_mask_loss``).
        reset_attention_mask: pretrain: the documents packed into a sample attend only within
            themselves (megatron's ``--reset-attention-mask``, MindSpeed's EOD reset): each
            microbatch becomes one packed (THD) row whose sequences end after each end-of-document
            token; with rotary embeddings their positions restart at 0, so set
            ``reset_position_ids`` too.
        reset_position_ids: restart positions after each end-of-document token (with rotary
            embeddings only together with ``reset_attention_mask``: megatron's rope ignores
            position ids, the packed documents restart it).
        eod_mask_loss: no loss on end-of-document tokens.
        cache_dir: where megatron caches its sample indices (default: next to the data).
        mock: synthetic random tokens instead of files (benchmarks, smoke tests).
        input: sft/dpo: raw instruction or pairwise records (a jsonl/json/parquet/... file or a
            directory, as ``preprocess-data --input``) tokenized through the same handlers at the
            start of the run (once: the result is cached under ``cache_dir``) instead of
            ``prefixes``.
        handler_name: the handler of ``input`` (default: the stage's Alpaca-style one).
        prompt_type: the conversation template of ``input`` (default: the tokenizer's chat template).
        map_keys: column names per handler attribute of ``input``, e.g. ``{"prompt": "question"}``.
        variable_seq_lengths: sft/dpo: pad each microbatch only to a multiple of
            ``pad_to_multiple_of`` rather than to ``micro_batch_size x seq_length`` tokens.
        pad_to_multiple_of: sft/dpo with ``variable_seq_lengths``: the padding multiple.

    For ``sft`` and ``dpo`` a prefix is preprocess-data's ``--output-prefix`` of instruction
    (``PREFIX_packed_input_ids_document`` ...) or pairwise data; ``seq_length`` is then the
    longest sample (longer ones are cut) and the row length of packed data.
    """

    prefixes: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    split: str = "969,30,1"
    seq_length: int = 128
    tokenizer: str | None = None
    eod_token_id: int | None = None
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    cache_dir: str | None = None
    mock: bool = False
    input: str | None = None
    handler_name: str | None = None
    prompt_type: str | None = None
    map_keys: dict[str, Any] | None = None
    variable_seq_lengths: bool = False
    pad_to_multiple_of: int = 8

    def check(self) -> None:
        """Check the section's own values (the stage and the model decide the rest).

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        if self.seq_length < 1:
            raise ConfigError(f"data.seq_length={self.seq_length} must be at least 1")
        if self.weights is not None and len(self.weights) != len(self.prefixes):
            raise ConfigError(
                f"data.weights has {len(self.weights)} entries for {len(self.prefixes)} data.prefixes; "
                "give one weight per prefix"
            )
        try:
            parts = [float(x) for x in self.split.replace("/", ",").split(",")]
        except ValueError:
            parts = []
        if not 1 <= len(parts) <= 3 or any(x < 0 or math.isnan(x) for x in parts) or parts[0] <= 0:
            raise ConfigError(
                f"data.split={self.split!r} must be up to three non-negative train,valid,test weights with a "
                "positive train weight, e.g. '969,30,1'"
            )


@recipe_section(name="EvalConfig")
@dataclass
class LLMEvalConfig(EvalConfig):
    """The core's ``eval`` section (:class:`mindspeed.training_config.EvalConfig`: interval, iters,
    at_end) on the validation split of ``data.split``, two global batches by default.
    """

    iters: int = 2


@recipe_section(
    name="CheckpointConfig",
    keys=(
        "save",
        "interval",
        "save_at_end",
        "async_save",
        "keep_last",
        "resume",
        "load",
        "finetune",
        "load_optimizer",
        "load_rng",
        "load_hf",
        "save_hf",
        "save_hf_dtype",
        "override_scheduler",
        "use_checkpoint_scheduler",
    ),
)
@dataclass
class LLMCheckpointConfig(CoreCheckpointConfig):
    """The core's ``checkpoint`` section (:class:`mindspeed.checkpointing.config.CheckpointConfig`: save,
    interval, keep_last, resume, the HF export and the schedule on resume) for megatron-core
    distributed checkpoints (``SAVE/iter_0000100``, ``latest_checkpointed_iteration.txt``), plus
    where a run starts from.

    Attributes:
        save_at_end: save after the last step.
        async_save: write checkpoints in the background: the step waits only for the state to be
            staged (copied to host memory) and the save planned; the checkpoint is marked complete
            (and becomes a resume point) once every rank's files are written, at a later step; at
            most one save is in flight (torchtitan's ``async_mode``, megatron's ``--async-save``).
        load: a checkpoint to start from (a ``save`` directory or one ``iter_*`` directory);
            a run whose ``save`` holds a complete checkpoint resumes from that instead.
        finetune: from ``load``, take the model weights only (step 0, fresh optimizer and data).
        load_optimizer: restore the optimizer state (and learning-rate schedule).
        load_rng: restore the random-number generators (same world size only).
        load_hf: a Hugging Face model directory to start from (step 0): the model section, the
            tokenizer and the weights come from it (converted on the fly by the bridges).
            Ignored when resuming from ``save``; ``load`` takes precedence.

    The schedule keys compare ``train.lr``, ``min_lr``, ``lr_warmup_init``, ``lr_warmup_steps``,
    ``lr_decay_style``, ``lr_decay_steps`` (or ``steps`` that sets it) and ``weight_decay``.
    """

    save_at_end: bool = True
    async_save: bool = False
    load: str | None = None
    finetune: bool = False
    load_optimizer: bool = True
    load_rng: bool = True
    load_hf: str | None = None

    def check(self) -> None:
        """The core's checks and what ``finetune`` needs.

        Raises:
            ConfigError: naming the key and the fix.
        """
        super().check()
        if self.finetune and not self.load:
            raise ConfigError("checkpoint.finetune needs checkpoint.load (the checkpoint whose weights to start from)")


#: The LLM suite's ``checkpoint`` section under its old name, for the engine build of
#: :mod:`mindspeed_llm.engine` (the RL actor's) until that import is updated.
CheckpointConfig = LLMCheckpointConfig


@recipe_section(
    name="LoraConfig",
    keys=("target_modules", "r", "alpha", "dropout", "qlora", "qlora_all_linears", "save_peft", "save_adapter"),
)
@dataclass
class LLMLoraConfig(CoreLoraConfig):
    """The core's ``lora`` section (:class:`mindspeed.lora_config.LoraConfig`) as LoRA / QLoRA of megatron
    linears, MindSpeed-LLM's ``--lora-*`` settings (rank 16, alpha 32 by default); off while
    ``target_modules`` is empty.

    ``target_modules`` are megatron linears: ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
    ``linear_fc2`` (``--lora-target-modules``); ``r`` is ``--lora-r``, ``alpha`` ``--lora-alpha``.
    ``save_peft`` writes the adapter at the end as a PEFT adapter directory for the Hugging Face model of
    ``checkpoint.load_hf`` (``peft.PeftModel.from_pretrained`` loads it).

    Attributes:
        qlora: keep the frozen base weights of the adapted linears in 4-bit NF4 with double
            quantisation (``--qlora``); needs ``checkpoint.load_hf``.
        qlora_all_linears: with ``qlora``, quantise the other decoder linears too.
        save_adapter: at the end, write the adapter alone as a Megatron LoRA checkpoint
            (what ``convert-ckpt --lora-load`` merges or exports).
    """

    NEEDS_TARGETS: ClassVar[tuple[str, ...]] = ("qlora", "save_peft", "save_adapter")
    EXAMPLE_TARGETS: ClassVar[tuple[str, ...]] = LORA_TARGETS

    r: int = 16
    alpha: float = 32.0
    qlora: bool = False
    qlora_all_linears: bool = False
    save_adapter: str | None = None

    def check_factors(self) -> None:
        """With LoRA on, the factors and targets as :class:`~mindspeed_llm.training.lora.LoraSettings`
        checks them (its ``--lora-*`` messages behind ``lora:``); off, nothing to check.

        Raises:
            ConfigError: naming the key and the fix.
        """
        if not self.enabled:
            return
        settings = LoraSettings(
            r=self.r, alpha=self.alpha, dropout=self.dropout, target_modules=tuple(self.target_modules)
        )
        try:
            settings.validate()
        except ValueError as err:
            raise ConfigError(f"lora: {err}") from err


@dataclass
class DpoConfig:
    """Direct preference optimisation (``mindspeed-llm dpo``), MindSpeed-LLM's ``--dpo-*`` settings.

    Attributes:
        beta: the KL strength (``--dpo-beta``).
        label_smoothing: the assumed label noise of the sigmoid loss (``--dpo-label-smoothing``).
        loss_type: ``sigmoid`` (DPO), ``hinge`` (SLiC) or ``ipo`` (``--dpo-loss-type``).
        ref_model: the frozen reference (a Hugging Face directory or a Megatron checkpoint);
            default: the weights the policy starts from (``--ref-model``).
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: Literal["sigmoid", "hinge", "ipo"] = "sigmoid"
    ref_model: str | None = None


@dataclass
class RmConfig:
    """Reward-model training (``mindspeed-llm rm``): the Bradley-Terry loss of TRL's ``RewardTrainer``.

    Attributes:
        margin: subtracted from every pair's reward difference inside the loss,
            ``-log sigmoid(r_chosen - r_rejected - margin)`` (TRL's per-pair ``margin`` column,
            here one value for every pair; 0: the plain Bradley-Terry loss).
        center_rewards_coefficient: adds ``coef * mean((r_chosen + r_rejected)^2)`` to the loss,
            which keeps the rewards centred on zero (TRL's ``center_rewards_coefficient``;
            ``None``: off).
    """

    margin: float = 0.0
    center_rewards_coefficient: float | None = None


@recipe_section(name="LoggingConfig")
@dataclass
class LLMLoggingConfig(LossCurveLoggingConfig):
    """The core's ``logging`` section (:class:`mindspeed.metrics.config.LoggingConfig`: dir, interval,
    progress, trackers and their settings, ``loss_curve``) plus the LLM suite's MFU denominator.

    Attributes:
        peak_tflops: peak TFLOP/s of one device, the MFU denominator (default: the table in
            :mod:`mindspeed.metrics.peak`).
    """

    peak_tflops: float | None = None
