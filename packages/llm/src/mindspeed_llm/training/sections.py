"""The sections of an LLM recipe (``model``, ``parallel``, ``train``, ``data``, ``eval``,
``checkpoint``, ``lora``, ``dpo``, ``logging``): one dataclass each, with their defaults and the
derived values they compute. :class:`~mindspeed_llm.training.config.PretrainConfig` holds them and
checks them against each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from mindspeed.config import ConfigError
from mindspeed.features.pipeline import parse_noop_layers
from mindspeed.metrics.config import LossCurveLoggingConfig
from mindspeed.model.shape import ModelShape


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
        max_nonfinite_steps: stop after this many consecutive steps with a NaN/Inf loss or gradient
            norm (each is skipped before the optimizer applies it: no update, no schedule step;
            megatron's ``check_for_nan_in_loss_and_grad`` raises instead); exit status 1.
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
        save_hf_dtype: dtype of the ``save_hf`` tensors: auto (the dtype the model was trained
            in), float32, bfloat16 or float16; its config.json always says the dtype written, so
            transformers loads what was trained.
        override_scheduler: on resume, when the recipe's learning-rate schedule (``train.lr``,
            ``min_lr``, ``lr_warmup_init``, ``lr_warmup_steps``, ``lr_decay_style``,
            ``lr_decay_steps`` or ``steps`` that sets it, ``weight_decay``) differs from the
            checkpoint's, the recipe wins: the schedule goes on from the resumed step with the
            recipe's values (megatron's ``--override-opt_param-scheduler``). A difference with
            neither this nor ``use_checkpoint_scheduler`` is an error that lists it.
        use_checkpoint_scheduler: on resume, the checkpoint's learning-rate schedule wins over a
            different one in the recipe (megatron's ``--use-checkpoint-opt_param-scheduler``).
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
    save_hf_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    override_scheduler: bool = False
    use_checkpoint_scheduler: bool = False


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


@dataclass
class LoggingConfig(LossCurveLoggingConfig):
    """The core's ``logging`` section (:class:`mindspeed.metrics.config.LoggingConfig`: dir, interval,
    progress, trackers and their settings, ``loss_curve``) plus the LLM suite's MFU denominator.

    Attributes:
        peak_tflops: peak TFLOP/s of one device, the MFU denominator (default: the table in
            :mod:`mindspeed.metrics.peak`).
    """

    peak_tflops: float | None = None
