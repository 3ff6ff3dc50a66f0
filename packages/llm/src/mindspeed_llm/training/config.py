"""Typed configs of ``mindspeed-llm pretrain``: one dataclass per section of a YAML recipe.

``PretrainConfig`` is the single source of truth: a recipe is a YAML mapping of its fields and
``key=value`` overrides use dotted paths (``train.lr=1e-3``); unknown keys are errors with a
suggestion (:func:`mindspeed.config.load_config`). :meth:`PretrainConfig.check` then checks
the values against each other and the world size, and names the key and the fix of anything
that does not fit.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from mindspeed.config import ConfigError, load_config
from mindspeed.features.manager import FeaturesConfig
from mindspeed.features.pipeline import check_noop_layers, parse_noop_layers
from mindspeed.model.shape import ModelShape
from mindspeed_llm.training.finetune_data import INSTRUCTION_KEYS, PAIRWISE_KEYS
from mindspeed_llm.training.lora import LoraSettings

#: Names of the sections of a recipe, in the order they are documented.
SECTIONS = ("model", "parallel", "train", "data", "eval", "checkpoint", "logging", "features", "lora", "dpo")

#: What a recipe trains: the command that runs it (``mindspeed-llm pretrain|sft|dpo``) sets it.
STAGES = ("pretrain", "sft", "dpo")


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
        position_embedding_type: ``rope``, ``learned_absolute`` or ``none``.
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
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"
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


@dataclass
class TrainConfig:
    """Steps, batches, optimizer and learning-rate schedule.

    Attributes:
        steps: optimizer steps to train (the last step number).
        micro_batch_size: sequences per microbatch on one data-parallel rank.
        global_batch_size: sequences per step over all ranks (default ``micro_batch_size`` x
            data-parallel size); gradients are accumulated over
            ``global / (micro x data-parallel)`` microbatches.
        seed: seed of the weights, megatron's RNG tracker and the data order.
        precision: ``fp32`` or ``bf16`` (bf16 weights with fp32 master weights in the optimizer).
        optimizer: ``adam`` (AdamW: decoupled weight decay) or ``sgd``.
        lr: peak learning rate.
        min_lr: learning rate at the end of the decay.
        lr_warmup_init: learning rate at step 0 of the warmup.
        lr_warmup_steps: linear warmup steps.
        lr_decay_style: ``cosine``, ``linear``, ``constant`` or ``inverse-square-root`` after the warmup.
        lr_decay_steps: steps from 0 to the end of the decay (default ``steps``).
        weight_decay: AdamW weight decay.
        adam_beta1: Adam beta1.
        adam_beta2: Adam beta2.
        adam_eps: Adam epsilon.
        sgd_momentum: SGD momentum.
        clip_grad: clip the global gradient norm to this (0: no clipping).
        max_nonfinite_steps: stop after this many consecutive steps with a NaN/Inf loss (each is skipped).
        exit_duration_mins: stop after this many minutes of training (megatron's
            ``--exit-duration-in-mins``): the current step finishes, a checkpoint is saved and
            the command exits 0; the same command resumes.
        deterministic: bit-reproducible runs (MindSpeed's ``--npu-deterministic``): torch's
            deterministic algorithms, the accelerator's deterministic settings
            (:func:`mindspeed.device.deterministic_mode`) and megatron's ``deterministic_mode``.
    """

    steps: int = 100
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["cosine", "linear", "constant", "inverse-square-root"] = "cosine"
    lr_decay_steps: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    max_nonfinite_steps: int = 3
    exit_duration_mins: float | None = None
    deterministic: bool = False

    def optimizer_config(self) -> OptimizerConfig:
        """The optimizer section of these settings."""
        return _section(OptimizerConfig, self)

    def scheduler_config(self) -> SchedulerConfig:
        """The learning-rate schedule section of these settings."""
        return _section(SchedulerConfig, self)


@dataclass
class OptimizerConfig:
    """The optimizer section: what :func:`mindspeed_llm.training.optim.build_optimizer` takes.

    A recipe's ``train`` section carries these fields (:meth:`TrainConfig.optimizer_config`);
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


@dataclass
class DataConfig:
    """Megatron indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``), blended and split.

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


@dataclass
class EvalConfig:
    """Periodic evaluation on the validation split.

    Attributes:
        interval: evaluate every this many steps (default: never during training).
        iters: global batches per evaluation; the same first samples of the split each time,
            so evaluations are comparable.
        at_end: evaluate after the last step too.
    """

    interval: int | None = None
    iters: int = 2
    at_end: bool = False


@dataclass
class CheckpointConfig:
    """Megatron-core distributed checkpoints (``SAVE/iter_0000100``, ``latest_checkpointed_iteration.txt``).

    Attributes:
        save: directory of the checkpoints (default: none are written).
        interval: save every this many steps (default: only at the end).
        save_at_end: save after the last step.
        keep_last: keep only this many newest complete checkpoints (default: all); damaged
            ones are neither counted nor deleted.
        resume: continue from the newest complete checkpoint in ``save`` (damaged newer ones
            are skipped with a warning). A ``save`` directory that holds checkpoints but no
            complete one is an error unless this is false; false trains from step 1 there.
        load: a checkpoint to start from (a ``save`` directory or one ``iter_*`` directory);
            a run whose ``save`` holds a complete checkpoint resumes from that instead.
        finetune: from ``load``, take the model weights only (step 0, fresh optimizer and data).
        load_optimizer: restore the optimizer state (and learning-rate schedule).
        load_rng: restore the random-number generators (same world size only).
        load_hf: a Hugging Face model directory to start from (step 0): the model section, the
            tokenizer and the weights come from it (converted on the fly by the bridges).
            Ignored when resuming from ``save``; ``load`` takes precedence.
        save_hf: write the final model as a Hugging Face directory here (config, tokenizer,
            sharded safetensors) at the end of the run.
    """

    save: str | None = None
    interval: int | None = None
    save_at_end: bool = True
    keep_last: int | None = None
    resume: bool = True
    load: str | None = None
    finetune: bool = False
    load_optimizer: bool = True
    load_rng: bool = True
    load_hf: str | None = None
    save_hf: str | None = None


@dataclass
class LoraConfig:
    """LoRA / QLoRA fine-tuning, MindSpeed-LLM's ``--lora-*`` settings; off while ``target_modules`` is empty.

    Attributes:
        target_modules: megatron linears to adapt: ``linear_qkv``, ``linear_proj``,
            ``linear_fc1``, ``linear_fc2`` (``--lora-target-modules``). Everything else is frozen.
        r: rank of the factors (``--lora-r``).
        alpha: the update is scaled by ``alpha / r`` (``--lora-alpha``).
        dropout: dropout on the LoRA input while training.
        qlora: keep the frozen base weights of the adapted linears in 4-bit NF4 with double
            quantisation (``--qlora``); needs ``checkpoint.load_hf``.
        qlora_all_linears: with ``qlora``, quantise the other decoder linears too.
        save_peft: at the end, write the adapter as a PEFT adapter directory for the Hugging
            Face model of ``checkpoint.load_hf`` (``peft.PeftModel.from_pretrained`` loads it).
        save_adapter: at the end, write the adapter alone as a Megatron LoRA checkpoint
            (what ``convert-ckpt --lora-load`` merges or exports).
    """

    target_modules: list[str] = field(default_factory=list)
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    qlora: bool = False
    qlora_all_linears: bool = False
    save_peft: str | None = None
    save_adapter: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on."""
        return bool(self.target_modules)


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
class LoggingConfig:
    """What the run shows and writes.

    Attributes:
        dir: where ``metrics.jsonl``, TensorBoard events and the loss curve go (default:
            ``checkpoint.save``; none when both are unset).
        interval: log a line every this many steps.
        progress: draw a progress bar (rank 0, on standard error).
        tensorboard: write TensorBoard event files to ``dir/tensorboard``.
        loss_curve: draw ``dir/loss.png`` at the end.
        peak_tflops: peak TFLOP/s of one device, the MFU denominator (default: the table in
            :mod:`mindspeed.metrics.peak`).
    """

    dir: str | None = None
    interval: int = 1
    progress: bool = True
    tensorboard: bool = True
    loss_curve: bool = True
    peak_tflops: float | None = None


@dataclass
class PretrainConfig:
    """A pretraining recipe: model, layout, optimisation, data, evaluation, checkpoints, features.

    Attributes:
        model: :class:`ModelConfig`. parallel: :class:`ParallelConfig`. train: :class:`TrainConfig`.
        data: :class:`DataConfig`. eval: :class:`EvalConfig`. checkpoint: :class:`CheckpointConfig`.
        logging: :class:`LoggingConfig`. features: ``mindspeed.features.FeaturesConfig``.
        lora: :class:`LoraConfig`. dpo: :class:`DpoConfig`. stage: ``pretrain``, ``sft`` or ``dpo`` (set by the command).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    stage: Literal["pretrain", "sft", "dpo"] = "pretrain"

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
        if not lora.enabled:
            for key in ("qlora", "save_peft", "save_adapter"):
                if getattr(lora, key):
                    raise ConfigError(
                        f"lora.{key} needs LoRA: set lora.target_modules (e.g. [linear_qkv, linear_proj, "
                        "linear_fc1, linear_fc2])"
                    )
            return

        try:
            LoraSettings(
                r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.target_modules)
            ).validate()
        except ValueError as err:
            raise ConfigError(f"lora: {err}") from err
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

    def check(self, world_size: int) -> None:
        """Check the values against each other and against ``world_size``.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        _check_positive(self)
        m, p, t, d = self.model, self.parallel, self.train, self.data
        model_parallel = p.tp * p.pp * p.cp
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp x parallel.pp x parallel.cp = "
                f"{model_parallel}; change the layout or the number of processes"
            )
        dp = world_size // model_parallel
        if p.cp > 1:
            _check_context_parallel(self)
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
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1; set parallel.sequence_parallel=false")
        if p.sequence_parallel and d.seq_length % p.tp:
            raise ConfigError(
                f"data.seq_length={d.seq_length} must be divisible by parallel.tp={p.tp} with sequence parallelism"
            )
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
        if p.overlap_param_gather and not p.distributed_optimizer:
            raise ConfigError("parallel.overlap_param_gather needs parallel.distributed_optimizer=true")
        micro_dp = t.micro_batch_size * dp
        gbs = self.global_batch_size(world_size)
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
        _check_optimizer(t)
        if t.lr < t.min_lr or t.lr_warmup_init > t.lr:
            raise ConfigError(
                f"need train.lr_warmup_init <= train.lr and train.min_lr <= train.lr "
                f"(got {t.lr_warmup_init}, {t.min_lr}, {t.lr})"
            )
        decay = t.lr_decay_steps or t.steps
        if t.steps and t.lr_warmup_steps and t.lr_warmup_steps >= decay:
            raise ConfigError(
                f"train.lr_warmup_steps={t.lr_warmup_steps} must be below train.lr_decay_steps "
                f"(default train.steps) = {decay}"
            )
        if not d.prefixes and not d.mock and not (d.input and self.stage != "pretrain"):
            raise ConfigError(
                "data.prefixes is empty: give the indexed datasets to train on (PREFIX of PREFIX.bin/.idx, "
                "as written by `mindspeed-llm preprocess-data`), or set data.mock=true"
            )
        for prefix in d.prefixes if self.stage == "pretrain" else ():
            missing = [prefix + suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()]
            if missing:
                raise ConfigError(
                    f"data.prefixes: {' and '.join(missing)} not found (a prefix names PREFIX.bin and "
                    "PREFIX.idx: preprocess-data's --output-prefix followed by _text_document)"
                )
        if d.weights is not None and len(d.weights) != len(d.prefixes):
            raise ConfigError(
                f"data.weights has {len(d.weights)} entries for {len(d.prefixes)} data.prefixes; "
                "give one weight per prefix"
            )
        _check_split(d.split)
        if m.vocab_size is None and d.tokenizer is None:
            raise ConfigError("model.vocab_size is unset; set it or give data.tokenizer to read it from")
        if (d.reset_position_ids or d.eod_mask_loss) and d.eod_token_id is None and d.tokenizer is None:
            raise ConfigError("data.reset_position_ids / data.eod_mask_loss need data.eod_token_id or data.tokenizer")
        _check_eod_reset(self)
        if self.stage != "pretrain":
            self._check_finetune()
        elif d.input is not None:
            raise ConfigError(
                "data.input (raw records tokenized at the start) is for sft and dpo; pretraining reads "
                "preprocessed data.prefixes"
            )
        self._check_lora()
        if self.checkpoint.finetune and not self.checkpoint.load:
            raise ConfigError("checkpoint.finetune needs checkpoint.load (the checkpoint whose weights to start from)")
        _check_megatron_fields(m.megatron)


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
    if config.stage == "dpo":
        raise ConfigError("dpo does not support parallel.cp > 1 yet; set parallel.cp=1")
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
        "train": ("micro_batch_size",),
        "data": ("seq_length",),
        "eval": ("iters",),
        "logging": ("interval",),
    }
    for section, keys in names.items():
        for key in keys:
            value = getattr(getattr(config, section), key)
            if value < 1:
                raise ConfigError(f"{section}.{key}={value} must be at least 1")
    for key, value in (
        ("train.steps", config.train.steps),
        ("train.max_nonfinite_steps", config.train.max_nonfinite_steps),
    ):
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    for key, value in (
        ("train.global_batch_size", config.train.global_batch_size),
        ("parallel.vpp", config.parallel.vpp),
        ("eval.interval", config.eval.interval),
        ("checkpoint.interval", config.checkpoint.interval),
        ("checkpoint.keep_last", config.checkpoint.keep_last),
        ("model.vocab_size", config.model.vocab_size),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1 (or unset)")


def _check_optimizer(t: TrainConfig) -> None:
    """The optimizer's numbers, named by their recipe keys (torch would say only "Invalid learning rate")."""
    if not t.lr > 0:
        raise ConfigError(f"train.lr={t.lr} must be positive; give a learning rate such as train.lr=3e-4")
    for key in ("min_lr", "lr_warmup_init", "weight_decay", "adam_eps", "sgd_momentum", "clip_grad"):
        value = getattr(t, key)
        if not value >= 0:
            raise ConfigError(f"train.{key}={value} must not be negative; give 0 or more")
    for key in ("adam_beta1", "adam_beta2"):
        value = getattr(t, key)
        if not 0 <= value < 1:
            raise ConfigError(f"train.{key}={value} must be in [0, 1), e.g. 0.9")


def _check_finetune_data(config: PretrainConfig) -> None:
    keys = PAIRWISE_KEYS if config.stage == "dpo" else INSTRUCTION_KEYS
    kind = (
        "pairwise (AlpacaStylePairwiseHandler ...)"
        if config.stage == "dpo"
        else "instruction (AlpacaStyleInstructionHandler ...)"
    )
    for prefix in config.data.prefixes:
        path = f"{prefix}_packed_{keys[0]}_document"
        if not (Path(path + ".bin").is_file() and Path(path + ".idx").is_file()):
            raise ConfigError(
                f"data.prefixes: {path}.bin/.idx not found; {config.stage} reads {kind} data: give the "
                "--output-prefix preprocess-data wrote it with"
            )


def _check_split(split: str) -> None:
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(x < 0 or math.isnan(x) for x in parts) or parts[0] <= 0:
        raise ConfigError(
            f"data.split={split!r} must be up to three non-negative train,valid,test weights with a "
            "positive train weight, e.g. '969,30,1'"
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
