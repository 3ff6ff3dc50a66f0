"""Typed configs of ``mindspeed-mm train``: one dataclass per section of a YAML recipe.

:class:`MMConfig` is the single source of truth: a recipe is a YAML mapping of its fields and
``key=value`` overrides use dotted paths (``train.lr=1e-5``); unknown keys are errors with a
suggestion (:func:`mindspeed.config.load_config`). :meth:`MMConfig.check` then checks the
values against each other and the world size, naming the key and the fix.

The sections follow MindSpeed-MM's native FSDP2 YAML (``model``, ``parallel``, ``data``,
``training``, ``features``) with the LLM suite's names (``train``, ``checkpoint``, ``logging``,
``lora``), so one recipe format serves every suite. The model directory picks the task
(:meth:`MMConfig.task`): a transformers ``config.json`` (``architectures``) trains a
vision-language model, a diffusers one (``_class_name``) a diffusion transformer, whose
flow-matching settings are the ``diffusion`` section (MindSpeed-MM's ``diffusion`` block).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mindspeed.checkpointing.config import CheckpointConfig
from mindspeed.config import ConfigError, load_config, recipe_section
from mindspeed.features.manager import FeaturesConfig
from mindspeed.lora_config import LoraConfig
from mindspeed.metrics.config import LossCurveLoggingConfig
from mindspeed.training_config import EvalConfig, OptimizerTrainConfig

#: Names of the sections of a recipe, in the order they are documented.
SECTIONS = ("model", "parallel", "train", "data", "eval", "diffusion", "checkpoint", "logging", "features", "lora")

#: Parts of a vision-language model that ``model.freeze`` names (MindSpeed-MM's ``freeze`` switches).
PARTS = ("vision_tower", "projector", "language_model")


@recipe_section(name="ModelConfig")
@dataclass
class ModelDirConfig:
    """The ``model`` section of an MM recipe: a local Hugging Face directory (transformers or diffusers),
    its family found by ``architectures`` (the LLM suite's ``model`` section is a megatron shape instead).

    Attributes:
        path: a local Hugging Face model directory (config.json, safetensors, tokenizer, image
            processor, chat template); nothing is downloaded.
        freeze: parts to keep fixed: ``vision_tower``, ``projector``, ``language_model``, or
            module-name prefixes (``model.visual.blocks.0``).
        attn_implementation: transformers' attention function: ``mindspeed`` (the core kernel
            registry's attention, registered in transformers' attention-function registry: packed
            samples without a dense mask, and Ulysses sequence parallelism), ``sdpa``, ``eager``, or
            any other registered name.
    """

    path: str | None = None
    freeze: list[str] = field(default_factory=list)
    attn_implementation: str = "mindspeed"


@recipe_section(name="ParallelConfig")
@dataclass
class FSDPParallelConfig:
    """The ``parallel`` section of an MM recipe: data parallelism through torch FSDP2 (``fully_shard``) and Ulysses sequence parallelism.

    Attributes:
        dp_replicate: replicas (HSDP's outer axis); the shard axis is what the world size
            leaves over (``world_size / dp_replicate``).
        ulysses_parallel_size: ranks that share each packed microbatch and split its language-model
            sequence, or, for a diffusion transformer, each microbatch's video/image tokens (Ulysses
            all-to-all in the attention; MindSpeed-MM's name). Data-parallel ranks are
            ``world_size / ulysses_parallel_size``; the attention heads must divide by it.
        fsdp_plan: module-name patterns wrapped as their own FSDP2 units, innermost first
            (``{*}`` or ``*`` matches one name part, as MindSpeed-MM's ``fsdp_plan.apply_modules``);
            the root is always wrapped. Default: the model family's plan.
        reshard_after_forward: free the gathered parameters after each unit's forward (ZeRO-3);
            false keeps them until the backward (ZeRO-2 like, more memory, less communication).
        context_parallel_algo: the attention of a diffusion transformer's sequence-parallel group
            (MindSpeed's names): ``ulysses_cp_algo`` (all-to-all over the heads), or ``megatron_cp_algo``
            (the core's ring attention: every rank of the group must hold as many tokens, the
            sequence a multiple of ``2 x ulysses_parallel_size``). With ``ring_attention_size > 1`` it
            follows from the two sizes (``hybrid_cp_algo`` when both are above 1, ``megatron_cp_algo`` when
            Ulysses is 1) and may be left unset or name that. Vision-language models take Ulysses only.
        ring_attention_size: a diffusion transformer's ring degree ``R`` (MindSpeed-MM's name): the
            sequence-parallel group is ``ulysses_parallel_size x ring_attention_size`` consecutive ranks,
            ``R`` rings of Ulysses groups of ``ulysses_parallel_size`` consecutive ranks (USP, the core's
            ``hybrid_cp_algo``: all-to-all inside a Ulysses group, ring attention across them).
    """

    dp_replicate: int = 1
    ulysses_parallel_size: int = 1
    fsdp_plan: list[str] | None = None
    reshard_after_forward: bool = True
    context_parallel_algo: Literal["ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo"] = "ulysses_cp_algo"
    ring_attention_size: int = 1

    def check(self) -> None:
        """Check the sizes (raises ``ConfigError`` naming the key and the fix)."""
        for key in ("dp_replicate", "ulysses_parallel_size", "ring_attention_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key}={getattr(self, key)} must be at least 1")

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that share each microbatch's tokens: ``ulysses_parallel_size x ring_attention_size``."""
        return self.ulysses_parallel_size * self.ring_attention_size

    @property
    def sequence_algo(self) -> str:
        """The attention of the sequence-parallel group (MindSpeed's name), from the sizes and the algorithm key."""
        if self.ring_attention_size == 1:
            return self.context_parallel_algo
        return "hybrid_cp_algo" if self.ulysses_parallel_size > 1 else "megatron_cp_algo"


@recipe_section(
    name="TrainConfig",
    keys=(
        "steps",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "seed",
        "precision",
        "lr",
        "min_lr",
        "lr_warmup_steps",
        "lr_decay_style",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "optimizer_impl",
        "clip_grad",
        "max_nonfinite_steps",
        "ema",
        "loss_type",
        "recompute_modules",
        "swap_modules",
        "compile",
        "deterministic",
        "retain_host_memory",
        "exit_duration_mins",
    ),
)
@dataclass
class MMTrainConfig(OptimizerTrainConfig):
    """The core's ``train`` section (:class:`mindspeed.training_config.OptimizerTrainConfig`: steps, seed,
    micro batch, precision, AdamW and its schedule, clipping, the stops, ``deterministic``) with
    MindSpeed-MM's defaults, plus accumulation, EMA, the loss reduction, recompute, swap and compile.

    ``micro_batch_size`` samples are packed into one sequence; ``bf16`` means bf16 compute
    parameters, fp32 sharded master parameters and fp32 gradient reduction (FSDP2's
    mixed-precision policy); ``lr_decay_style`` is ``constant``, ``linear`` or ``cosine`` (to
    ``min_lr`` at ``steps``); weight decay is not applied to biases and norms.

    Attributes:
        gradient_accumulation_steps: microbatches per optimizer step on one rank.
        optimizer_impl: the ``adamw`` kernel of ``mindspeed.ops`` (``auto``, ``reference``,
            ``foreach``, ``fused``).
        ema: decay of an exponential moving average of the weights (MindSpeed's ``fused_ema_adamw``
            with ``--ema-decay``, e.g. 0.9999; 0: none). The optimizer becomes EMA-AdamW (the
            ``ema_adamw`` kernel, ``optimizer_impl`` picks it), the averages travel in the
            checkpoints, and ``checkpoint.save_hf`` exports the averages.
        loss_type: MindSpeed-MM's loss reductions: ``default`` (token mean per microbatch, mean
            over microbatches and ranks, as Hugging Face), ``per_sample`` (token mean per sample,
            mean over the global batch's samples), ``per_token`` (sum over the global batch /
            its answer tokens).
        recompute_modules: module-name patterns whose activations are recomputed in the backward
            (activation checkpointing), e.g. ``model.language_model.layers.{*}``.
        swap_modules: module-name patterns whose saved activations go to host memory in the
            forward and come back, one module ahead, in the backward (``mindspeed.memory``'s
            activation swap, MindSpeed's ``--swap-attention`` for any module); copied, not
            recomputed, so training is unchanged. A module both recomputed and swapped is refused.
        compile: regional compilation of a diffusion transformer (:mod:`mindspeed_mm.models.dit_compile`):
            ``torch.compile`` of each repeated block's forward: ``true`` (or ``default``), ``max-autotune``
            (its own GEMM kernels timed against ATen's; longer compile); ``false``: eager. It pays once the steps
            outlast the compile (seconds a block class on a CPU, measured in ``docs/mm/dit-parallelism.md``).
        retain_host_memory: glibc's malloc keeps freed host memory for the next step instead of giving it
            back to the kernel and faulting it in again (:func:`mindspeed.device.retain_freed_host_memory`;
            on the CPU ~10% of a small DiT's step, the same peak RSS; ``docs/mm/dit-parallelism.md``).
    """

    precision: Literal["fp32", "bf16"] = "bf16"
    lr: float = 1e-5
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    weight_decay: float = 0.0
    adam_beta2: float = 0.999
    gradient_accumulation_steps: int = 1
    optimizer_impl: str = "auto"
    ema: float = 0.0
    loss_type: Literal["default", "per_sample", "per_token"] = "default"
    recompute_modules: list[str] = field(default_factory=list)
    swap_modules: list[str] = field(default_factory=list)
    compile: bool | Literal["default", "max-autotune"] = False
    retain_host_memory: bool = True

    def check(self) -> None:
        """The core's checks, accumulation and the moving average.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        if self.gradient_accumulation_steps < 1:
            raise ConfigError(
                f"train.gradient_accumulation_steps={self.gradient_accumulation_steps} must be at least 1"
            )
        super().check()
        if not 0 <= self.ema < 1:
            raise ConfigError(f"train.ema={self.ema} must lie in [0, 1) (0: no moving average; e.g. 0.9999)")


@recipe_section(name="DataConfig")
@dataclass
class MediaDataConfig:
    """The ``data`` section of an MM recipe: mllm_format data (LLaMA-Factory / MindSpeed-MM): ``messages`` with ``<image>`` / ``<video>`` placeholders
    plus ``images`` / ``videos``.

    Attributes:
        files: JSON (a list of samples) or JSONL (one sample a line) files.
        valid_files: held-out files in the same format, scored for the validation loss (``eval``
            section; vision-language models only). ``max_samples`` and ``shuffle`` do not apply to them.
        image_dir: folder relative image (and video) paths are read from (default: the data file's folder;
            MindSpeed-MM's ``data_folder``).
        cutoff_len: samples longer than this many tokens are cut (their images must fit before it).
        image_max_pixels: images are resized to at most this many pixels.
        image_min_pixels: and to at least this many.
        video_fps: video frames sampled per second (LLaMA-Factory's ``video_fps``).
        video_maxlen: at most this many frames per video (``video_maxlen``).
        video_max_pixels: video frames are resized to at most this many pixels (``video_max_pixels``).
        video_min_pixels: and to at least this many (``video_min_pixels``).
        workers: processes that encode the samples before training starts (tokenizer, image and
            video processors; LLaMA-Factory's ``preprocessing_num_workers``); 0: each sample is
            encoded in the training process when first used.
        cache_dir: keep the encoded samples here (one folder per key of the data files' contents,
            the tokenizer and processors, and the settings above), so a later run with the same
            key reads them instead of encoding again; unset: no cache.
        train_on_prompt: compute the loss on the prompts too (not only the answers).
        mask_history: loss on the last answer only.
        shuffle: a new order of the samples each epoch (seeded by ``train.seed``).
        max_samples: use only the first this many samples.
        features: a feature cache (latents and text embeddings, :mod:`mindspeed_mm.data.features`)
            that a diffusion transformer trains from; ``mindspeed-mm extract-features`` writes it from
            ``files``. Unset: a diffusion transformer trains straight from the media of ``files``.
        text_len: text embeddings are zero-padded to this many tokens, as the pipelines pad them
            (default: the model family's, 512 for Wan, FLUX and Qwen-Image; SD3's counts CLIP's 77 and T5's 256: 333).
        encoders: a diffusers pipeline directory holding the VAE and text encoder(s) (``vae``,
            ``text_encoder``, ``tokenizer``, FLUX's ``text_encoder_2``, ``tokenizer_2``, SD3's ``_2`` and ``_3``) that turn
            media of ``files`` into features (default: the folder above ``model.path``).
        resolutions: ``[height, width]`` buckets for media (MindSpeed-MM's video/image JSON): each
            sample is resized to cover the bucket of the closest aspect ratio and centre-cropped to
            it. Empty: each sample's own size, floored to multiples of ``hw_stride``.
        hw_stride: heights and widths are multiples of this (the VAE's and the patch's strides).
        frame_counts: frame-count buckets of a video: it takes the largest it can fill at ``fps``
            (a video model's VAE needs ``k x its time stride + 1``, 4k+1 for Wan). An image is one frame.
        fps: frames are sampled at this rate (MindSpeed-MM's ``train_fps``; 0: every source frame).
        skip_bad: skip unreadable media, videos too short and samples without a caption, with a
            count in the log (else the first one is an error naming its file and line).
        shard_size: samples per shard of a feature cache that ``extract-features`` writes.
        vae_dtype: ``float32`` or ``bfloat16``: the VAE's weights and compute (diffusers runs Wan's VAE in float32).
        text_encoder_dtype: ``float32`` or ``bfloat16``: the text encoders' (Wan's UMT5 ships in bfloat16).
            Features are stored in float32 either way.
    """

    files: list[str] = field(default_factory=list)
    valid_files: list[str] = field(default_factory=list)
    image_dir: str | None = None
    cutoff_len: int = 2048
    image_max_pixels: int = 262144
    image_min_pixels: int = 3136
    video_fps: float = 2.0
    video_maxlen: int = 128
    video_max_pixels: int = 65536
    video_min_pixels: int = 256
    workers: int = 0
    cache_dir: str | None = None
    train_on_prompt: bool = False
    mask_history: bool = False
    shuffle: bool = True
    max_samples: int | None = None
    features: str | None = None
    text_len: int | None = None
    encoders: str | None = None
    resolutions: list[list[int]] = field(default_factory=list)
    hw_stride: int = 16
    frame_counts: list[int] = field(default_factory=lambda: [81])
    fps: float = 16.0
    skip_bad: bool = False
    shard_size: int = 64
    vae_dtype: Literal["float32", "bfloat16"] = "float32"
    text_encoder_dtype: Literal["float32", "bfloat16"] = "float32"

    def check(self) -> None:
        """Check the section's own values and that the files it names exist (the task decides the rest).

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        if self.cutoff_len < 1:
            raise ConfigError(f"data.cutoff_len={self.cutoff_len} must be at least 1")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"data.max_samples={self.max_samples} must be at least 1 (or unset)")
        for key, names in (("data.files", self.files), ("data.valid_files", self.valid_files)):
            for name in names:
                if not Path(name).is_file():
                    raise ConfigError(f"{key}: {name!r} does not exist")
        if self.image_min_pixels > self.image_max_pixels:
            raise ConfigError(
                f"data.image_min_pixels={self.image_min_pixels} is above data.image_max_pixels="
                f"{self.image_max_pixels}; lower it"
            )
        if self.video_min_pixels > self.video_max_pixels:
            raise ConfigError(
                f"data.video_min_pixels={self.video_min_pixels} is above data.video_max_pixels="
                f"{self.video_max_pixels}; lower it"
            )
        if self.video_fps <= 0 or self.video_maxlen < 1 or self.workers < 0:
            raise ConfigError(
                f"data.video_fps={self.video_fps} must be positive, data.video_maxlen={self.video_maxlen} at least 1, "
                f"data.workers={self.workers} not negative"
            )

    def check_media(self) -> None:
        """Check the media keys (video/image + caption files of a diffusion transformer).

        Raises:
            ConfigError: naming the key and the fix.
        """
        if self.hw_stride < 1 or self.shard_size < 1 or self.fps < 0:
            raise ConfigError(
                f"data.hw_stride={self.hw_stride} and data.shard_size={self.shard_size} must be at least 1, "
                f"data.fps={self.fps} not negative"
            )
        if not self.frame_counts or min(self.frame_counts) < 1:
            raise ConfigError(f"data.frame_counts={self.frame_counts} must list positive frame counts, e.g. [81]")
        for hw in self.resolutions:
            if len(hw) != 2 or min(hw) < 1 or hw[0] % self.hw_stride or hw[1] % self.hw_stride:
                raise ConfigError(
                    f"data.resolutions: {hw} must be [height, width], multiples of data.hw_stride={self.hw_stride}"
                )


@recipe_section(name="EvalConfig")
@dataclass
class MMEvalConfig(EvalConfig):
    """The core's ``eval`` section (:class:`mindspeed.training_config.EvalConfig`: interval, iters, at_end)
    on ``data.valid_files`` (vision-language models); by default every held-out sample (``iters``
    unset), at the end only. A global batch of samples is ``train.micro_batch_size x
    train.gradient_accumulation_steps x`` data-parallel ranks.

    The held-out samples, in file order, are scored under ``train.loss_type`` as one batch (packed
    ``train.micro_batch_size`` to a microbatch, spread over the data-parallel ranks), without
    gradients and with dropout off, and written as ``{"kind": "eval", "loss": ...}`` records.
    """

    at_end: bool = True


@dataclass
class DiffusionConfig:
    """Flow matching of a diffusion transformer (``x_t = (1 - s) x0 + s noise``, target ``noise - x0``).

    Timesteps are drawn on the grid of diffusers' ``FlowMatchEulerDiscreteScheduler``:
    ``num_train_timesteps`` sigmas from 1 down to ``1 / num_train_timesteps``, shifted as
    ``shift s / (1 + (shift - 1) s)`` (the same grid as MindSpeed-MM's Wan scheduler). A number
    ``u`` in [0, 1) from ``timestep_sampling`` picks grid index ``floor(u N)`` (0: pure noise).
    MindSpeed-MM's Wan recipes: ``shift: 5``, ``timestep_sampling: uniform``,
    ``timestep_per: microbatch``, ``loss_weighting: bsmntw``; diffusers' examples draw per
    sample (``logit_normal`` or ``uniform``) with ``none`` / ``sigma_sqrt`` / ``cosmap`` weights.

    Attributes:
        num_train_timesteps: grid points.
        shift: the grid's shift (1: none).
        timestep_sampling: ``uniform``, ``logit_normal`` (``sigmoid(N(logit_mean, logit_std))``) or
            ``mode`` (SD3's mode sampling with ``mode_scale``), as diffusers'
            ``compute_density_for_timestep_sampling``.
        logit_mean: mean of ``logit_normal``.
        logit_std: standard deviation of ``logit_normal``.
        mode_scale: scale of ``mode``.
        timestep_per: one timestep per ``sample`` (diffusers) or per ``microbatch`` (MindSpeed-MM).
        min_timestep_boundary: ``u`` is mapped into [min, max) of the grid (Wan2.2's experts:
            the high-noise one trains [0, 0.417), the low-noise one [0.417, 1)).
        max_timestep_boundary: see ``min_timestep_boundary``.
        expert: Wan2.2's two-expert mixture (``WanPipeline`` with ``transformer_2``): ``none`` (one
            transformer), ``high_noise`` (``model.path`` is the pipeline's ``transformer``, trained on the
            grid timesteps ``t >= boundary``), ``low_noise`` (``transformer_2``, ``t < boundary``) or
            ``both`` (``model.path`` is ``transformer``, its sibling ``transformer_2`` trains beside it, each
            sample's timestep routed to its expert). ``boundary = boundary_ratio x num_train_timesteps``.
        boundary_ratio: the switch of the experts; None: the pipeline's ``model_index.json`` (the parent
            of ``model.path``) gives it.
        loss_weighting: ``none``, ``sigma_sqrt`` (1/sigma^2), ``cosmap`` (SD3), or ``bsmntw``
            (MindSpeed-MM's / DiffSynth's Gaussian bump over the grid, mean 1).
        text_dropout: probability that a sample's text embedding is replaced by the empty
            caption's (classifier-free guidance); MindSpeed-MM's ``cfg``.
        guidance_scale: the guidance a guidance-distilled model (FLUX.1-dev) is trained with.
        first_frame_ratio: Wan2.2 TI2V: share of samples trained image-to-video (their first latent frame
            given clean at timestep 0, left out of their loss); the others train text-to-video.
    """

    num_train_timesteps: int = 1000
    shift: float = 1.0
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    timestep_per: Literal["sample", "microbatch"] = "sample"
    min_timestep_boundary: float = 0.0
    max_timestep_boundary: float = 1.0
    expert: Literal["none", "high_noise", "low_noise", "both"] = "none"
    boundary_ratio: float | None = None
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap", "bsmntw"] = "none"
    text_dropout: float = 0.0
    guidance_scale: float = 1.0
    first_frame_ratio: float = 0.0

    def check(self) -> None:
        """Check the values (raises ``ConfigError`` naming the key and the fix)."""
        if self.num_train_timesteps < 1:
            raise ConfigError(f"diffusion.num_train_timesteps={self.num_train_timesteps} must be at least 1")
        if self.shift <= 0:
            raise ConfigError(f"diffusion.shift={self.shift} must be positive (1: no shift)")
        if not 0 <= self.min_timestep_boundary < self.max_timestep_boundary <= 1:
            raise ConfigError(
                f"diffusion.min_timestep_boundary={self.min_timestep_boundary} and "
                f"max_timestep_boundary={self.max_timestep_boundary} must satisfy 0 <= min < max <= 1"
            )
        if self.expert != "none" and (self.min_timestep_boundary, self.max_timestep_boundary) != (0.0, 1.0):
            raise ConfigError(
                f"diffusion.expert={self.expert} sets the timestep range from boundary_ratio; remove "
                "diffusion.min_timestep_boundary / max_timestep_boundary"
            )
        if self.boundary_ratio is not None and not 0 < self.boundary_ratio < 1:
            raise ConfigError(f"diffusion.boundary_ratio={self.boundary_ratio} must be in (0, 1) (Wan2.2 T2V: 0.875)")
        if not 0 <= self.text_dropout <= 1:
            raise ConfigError(f"diffusion.text_dropout={self.text_dropout} must be in [0, 1]")
        if not 0 <= self.first_frame_ratio <= 1:
            raise ConfigError(f"diffusion.first_frame_ratio={self.first_frame_ratio} must be in [0, 1]")
        if self.logit_std <= 0:
            raise ConfigError(f"diffusion.logit_std={self.logit_std} must be positive")


@recipe_section(
    name="CheckpointConfig",
    keys=(
        "save",
        "interval",
        "save_at_end",
        "keep_last",
        "resume",
        "save_hf",
        "export_ema",
        "save_hf_dtype",
        "override_scheduler",
        "use_checkpoint_scheduler",
    ),
)
@dataclass
class MMCheckpointConfig(CheckpointConfig):
    """The core's ``checkpoint`` section (:class:`mindspeed.checkpointing.config.CheckpointConfig`: save,
    interval, keep_last, resume, the HF export and the schedule on resume) for torch DCP checkpoints,
    sharded as trained (``SAVE/step_00000010``, marked complete last), plus two MM keys.

    ``save_hf`` writes config, safetensors, tokenizer, image processor and chat template
    (diffusers' config has no dtype: its ``from_pretrained`` loads float32 unless given
    ``torch_dtype``); the schedule keys compare ``train.lr``, ``min_lr``, ``lr_warmup_steps``,
    ``lr_decay_style``, ``steps`` (that the decay ends at) and ``weight_decay``.

    Attributes:
        save_at_end: save after the last step.
        export_ema: with ``train.ema``, the exports (``save_hf``, ``lora.save_peft``) hold the moving
            averages of the weights; false: the raw trained weights.
    """

    save_at_end: bool = True
    export_ema: bool = True


@recipe_section(name="LoraConfig", keys=("target_modules", "parts", "r", "alpha", "dropout", "save_peft"))
@dataclass
class MMLoraConfig(LoraConfig):
    """The core's ``lora`` section (:class:`mindspeed.lora_config.LoraConfig`: target_modules, r, alpha,
    dropout, save_peft and their checks) for LoRA through peft (MindSpeed-MM's ``--lora-*``), plus the
    model's parts to adapt; off while ``target_modules`` is empty.

    Everything but the LoRA factors is frozen; ``checkpoint.save_hf`` then writes the merged model.
    ``target_modules`` are matched on the last parts of a module's name: ``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj`` (MindSpeed-MM's set for the
    language model), or ``self_attn.q_proj``; for a diffusion transformer ``default`` (its attention
    projections: Wan ``to_q``, ``to_k``, ``to_v``, ``to_out.0``; FLUX, SD3 and Qwen-Image those and ``add_q_proj`` ...
    ``to_add_out``). ``save_peft`` writes a PEFT directory for a vision-language model
    (``peft.PeftModel.from_pretrained(base, DIR)`` loads it over the model of ``model.path``), a
    diffusers LoRA (``pytorch_lora_weights.safetensors``) for a diffusion transformer
    (``pipe.load_lora_weights(DIR)`` loads it into the pipeline's transformer).

    Attributes:
        parts: where the targets are looked for: parts of the family (``language_model``,
            ``vision_tower``, ``projector``) or module-name prefixes (``blocks``). Default: the
            language model of a vision-language model (MindSpeed-MM's LoRA leaves the vision side
            frozen), the whole diffusion transformer.
    """

    parts: list[str] = field(default_factory=list)


@dataclass
class MMConfig:
    """A ``mindspeed-mm train`` recipe.

    Attributes:
        model: :class:`ModelDirConfig`. parallel: :class:`FSDPParallelConfig`. train: :class:`MMTrainConfig`.
        data: :class:`MediaDataConfig`. eval: :class:`MMEvalConfig`. diffusion: :class:`DiffusionConfig` (diffusion transformers only).
        checkpoint: :class:`MMCheckpointConfig`. logging: the core's
            :class:`~mindspeed.metrics.config.LossCurveLoggingConfig` (with ``loss_curve``).
        features: ``mindspeed.features.FeaturesConfig``. lora: :class:`MMLoraConfig`.
    """

    model: ModelDirConfig = field(default_factory=ModelDirConfig)
    parallel: FSDPParallelConfig = field(default_factory=FSDPParallelConfig)
    train: MMTrainConfig = field(default_factory=MMTrainConfig)
    data: MediaDataConfig = field(default_factory=MediaDataConfig)
    eval: MMEvalConfig = field(default_factory=MMEvalConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    checkpoint: MMCheckpointConfig = field(default_factory=MMCheckpointConfig)
    logging: LossCurveLoggingConfig = field(default_factory=LossCurveLoggingConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    lora: MMLoraConfig = field(default_factory=MMLoraConfig)

    def log_dir(self) -> Path | None:
        """Where metrics are written (``logging.dir``, else ``checkpoint.save``)."""
        target = self.logging.dir or self.checkpoint.save
        return Path(target) if target else None

    def task(self) -> str:
        """The training task the model directory calls for: ``dit`` for a diffusers directory (its
        config.json names ``_class_name``), else ``vlm``."""
        config = Path(self.model.path or "") / "config.json"
        if self.model.path and config.is_file() and "_class_name" in json.loads(config.read_text()):
            return "dit"
        return "vlm"

    def samples_per_step(self, world_size: int) -> int:
        """Samples in one optimizer step over all ranks (sequence-parallel ranks share theirs)."""
        t = self.train
        return t.micro_batch_size * t.gradient_accumulation_steps * (world_size // self.parallel.sequence_parallel_size)

    def check(self, world_size: int) -> None:
        """Check each section's values, then the sections against each other and ``world_size``.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        self.logging.check()
        self.parallel.check()
        self.lora.check()
        self.eval.check()
        self.train.check()
        self.checkpoint.check()
        self._check_layout(world_size)
        m, p, t, d = self.model, self.parallel, self.train, self.data
        if m.path is None:
            raise ConfigError(
                "model.path is unset: give a local Hugging Face model directory (config.json with "
                "`architectures`, weights, tokenizer, image processor)"
            )
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(f"model.path={m.path!r} has no config.json; give a local Hugging Face model directory")
        if self.task() == "dit":
            self._check_dit()
        elif t.compile:
            raise ConfigError(
                f"train.compile={t.compile}: regional compilation applies to diffusion transformers; "
                "set train.compile=false for vision-language models"
            )
        elif p.context_parallel_algo != "ulysses_cp_algo" or p.ring_attention_size != 1:
            raise ConfigError(
                f"parallel.context_parallel_algo={p.context_parallel_algo}, parallel.ring_attention_size="
                f"{p.ring_attention_size}: vision-language models take ulysses_cp_algo only; remove the keys"
            )
        elif not d.files:
            raise ConfigError(
                "data.files is empty: give mllm_format JSON/JSONL files (messages with <image> / <video> "
                "placeholders plus images / videos)"
            )
        d.check()
        if self.eval.interval is not None and not d.valid_files:
            raise ConfigError(
                f"eval.interval={self.eval.interval} needs held-out data: set data.valid_files (mllm_format files)"
            )
        if self.lora.enabled and m.freeze:
            raise ConfigError(
                "model.freeze with LoRA: everything but the LoRA factors is frozen already; remove model.freeze"
            )
        if self.features.settings:
            raise ConfigError(
                f"features.settings: {', '.join(self.features.settings)} do not apply to mindspeed-mm yet; remove them"
            )

    def _check_layout(self, world_size: int) -> None:
        """The data-parallel replicas and the sequence-parallel group against ``world_size`` and the attention."""
        p = self.parallel
        if world_size % p.dp_replicate:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.dp_replicate={p.dp_replicate}; "
                "change one of them"
            )
        if world_size % (p.dp_replicate * p.sequence_parallel_size):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.dp_replicate={p.dp_replicate} x "
                f"parallel.ulysses_parallel_size={p.ulysses_parallel_size} x "
                f"parallel.ring_attention_size={p.ring_attention_size}; change one of them"
            )
        if p.ulysses_parallel_size > 1 and self.model.attn_implementation != "mindspeed":
            raise ConfigError(
                f"parallel.ulysses_parallel_size={p.ulysses_parallel_size} needs "
                f"model.attn_implementation=mindspeed (got {self.model.attn_implementation!r})"
            )

    def _check_dit(self) -> None:
        d = self.data
        if d.valid_files or self.eval.interval is not None:
            raise ConfigError(
                f"data.valid_files / eval.interval: {self.model.path} is a diffusion transformer, which has no "
                "validation loss yet (vision-language models do); remove those keys"
            )
        if d.features is None and not d.files:
            raise ConfigError(
                f"data.features is unset and data.files is empty: {self.model.path} is a diffusion "
                "transformer, which trains from a feature cache or video/image + caption files; give one"
            )
        if d.features is not None and not (Path(d.features) / "index.jsonl").is_file():
            raise ConfigError(
                f"data.features={d.features!r} has no index.jsonl; run `mindspeed-mm extract-features` "
                "or give a feature cache directory"
            )
        self.data.check_media()
        p = self.parallel
        if p.ring_attention_size == 1 and p.context_parallel_algo == "hybrid_cp_algo":
            raise ConfigError(
                "parallel.context_parallel_algo=hybrid_cp_algo needs parallel.ring_attention_size > 1 (the ring "
                "degree; the Ulysses degree is parallel.ulysses_parallel_size)"
            )
        if p.ring_attention_size > 1 and p.context_parallel_algo not in ("ulysses_cp_algo", p.sequence_algo):
            raise ConfigError(
                f"parallel.context_parallel_algo={p.context_parallel_algo} contradicts parallel.ulysses_parallel_size="
                f"{p.ulysses_parallel_size} x parallel.ring_attention_size={p.ring_attention_size}, which make "
                f"{p.sequence_algo}; remove the key"
            )
        t = self.train
        if t.compile and (p.ulysses_parallel_size > 1 or p.ring_attention_size > 1 or t.swap_modules):
            raise ConfigError(
                f"train.compile={t.compile} with parallel.ulysses_parallel_size={p.ulysses_parallel_size}, "
                f"parallel.ring_attention_size={p.ring_attention_size} and train.swap_modules={t.swap_modules}: "
                "compiled blocks do not take sequence parallelism or activation swap yet; set train.compile=false"
            )
        if d.text_len is not None and d.text_len < 1:
            raise ConfigError(f"data.text_len={d.text_len} must be at least 1 (or unset)")
        self.diffusion.check()


def load_mm_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MMConfig:
    """Read a recipe and apply ``key=value`` overrides (strict: unknown keys are errors).

    Args:
        path: YAML recipe (``None``: defaults only).
        overrides: dotted ``key=value`` strings, e.g. ``["train.steps=10", "train.lr=1e-4"]``.

    Raises:
        ConfigError: naming the key and suggesting the closest known one.
    """
    return load_config(MMConfig, path, overrides)
