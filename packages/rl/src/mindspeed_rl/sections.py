"""The sections of a GRPO recipe: one dataclass per section of the YAML file.

:class:`~mindspeed_rl.config.GRPOConfig` holds one of each; the checks
(:mod:`mindspeed_rl.config_checks`) read them through :class:`RecipeSections`, so neither
module imports the other's recipe class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mindspeed.features import FeaturesConfig
from mindspeed.metrics.config import LoggingConfig as CoreLoggingConfig
from mindspeed_rl.algorithms.losses import PolicyLossConfig, policy_loss_config
from mindspeed_rl.ppo_sections import KLControlConfig

#: Names of the sections of a recipe, in the order they are documented.
SECTIONS = (
    "actor",
    "rollout",
    "reference",
    "reward",
    "algorithm",
    "buffer",
    "data",
    "ray",
    "train",
    "logging",
    "checkpoint",
    "features",
)


@dataclass
class ActorConfig:
    """The policy being trained (megatron-core engine of the LLM suite).

    Attributes:
        model: a Hugging Face model directory or a Megatron checkpoint to start from (required).
        tokenizer: a tokenizer directory, or ``demo`` (default: the one in ``model``).
        tp: tensor-parallel size. pp: pipeline-parallel size. dp: data-parallel size.
        lr: peak learning rate. min_lr: learning rate at the end of the decay.
        lr_warmup_steps: linear warmup steps. lr_decay_style: ``constant``, ``cosine`` or ``linear``.
        weight_decay: AdamW weight decay. adam_beta1, adam_beta2: Adam betas.
        clip_grad: clip the global gradient norm to this (0: no clipping).
        precision: ``fp32`` or ``bf16`` (with fp32 master weights).
        micro_batch_size: sequences per forward/backward on one data-parallel rank.
        max_tokens_per_micro_batch: balance micro-batches by tokens under this budget instead
            of a fixed count of sequences (dynamic batch size; default: off).
        mini_batch_size: prompts per optimizer update (default ``train.global_batch``: one
            update per rollout batch, fully on-policy).
        ppo_epochs: passes over each rollout batch.
        share_prompt: pack the responses of a microbatch that share a prompt (a GRPO group) as one
            segment ``[prompt, r_1, ..., r_G]`` so the update runs the prompt once, not once per
            response (same log-probs and gradients). Unset: on where it applies (pp = 1, rope or
            learned positions, no MLA/MTP); true: on, an error where it cannot apply; false: off.
        offload_optimizer: co-location: optimizer state to host memory while the rollout generates.
        offload_grad: co-location: gradients to host memory while the rollout generates.
    """

    model: str | None = None
    tokenizer: str | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    precision: Literal["fp32", "bf16"] = "fp32"
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    mini_batch_size: int | None = None
    ppo_epochs: int = 1
    share_prompt: bool | None = None
    offload_optimizer: bool = True
    offload_grad: bool = True

    def world_size(self) -> int:
        """Devices of the actor: ``tp x pp x dp``."""
        return self.tp * self.pp * self.dp


@dataclass
class RolloutConfig:
    """Generation of the responses.

    Attributes:
        engine: ``builtin`` (the LLM suite's KV-cache engine, runs everywhere) or ``vllm``.
        n: responses per prompt (the GRPO group size).
        temperature, top_p, top_k: sampling (``top_k`` 0: off).
        max_prompt_length: prompts longer than this (in tokens) are left out.
        max_new_tokens: the longest response.
        tp: tensor-parallel size of the inference engine (may differ from the actor's).
        colocate: share the actor's devices (weights resharded in, training state offloaded);
            false: the rollout runs on its own ``num_devices``.
        num_devices: devices of a separated rollout pool.
        max_num_seqs: sequences the engine decodes at once.
        gpu_memory_utilization: vLLM's share of device memory.
        stop: strings that end a response.
    """

    engine: Literal["builtin", "vllm"] = "builtin"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int = 512
    max_new_tokens: int = 256
    tp: int = 1
    colocate: bool = True
    num_devices: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.5
    stop: list[str] = field(default_factory=list)


@dataclass
class ReferenceConfig:
    """The frozen reference policy of the KL penalty (only built when the KL coefficient is > 0).

    Attributes:
        model: its weights (default: ``actor.model``).
        colocate: share the actor's devices.
        offload: keep its weights in host memory except while it computes log-probs (co-location).
    """

    model: str | None = None
    colocate: bool = True
    offload: bool = True


@dataclass
class RewardConfig:
    """How responses are scored: rule verifiers and an optional reward model, summed with weights.

    Attributes:
        verifiers: names in :data:`mindspeed_rl.rewards.VERIFIERS` (``math``, ``format``).
        weights: one per verifier (default: 1 each).
        options: verifier name -> its options (e.g. ``{format: {preset: think}}``).
        model: a Hugging Face sequence-classification directory (default: none).
        model_weight: weight of the reward model's score.
        model_batch_size: texts per reward-model forward.
    """

    verifiers: list[str] = field(default_factory=lambda: ["math"])
    weights: list[float] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    model_weight: float = 1.0
    model_batch_size: int = 8


@dataclass
class AlgorithmConfig:
    """Advantages, policy loss and DAPO's extras. Loss settings left unset take the loss's defaults.

    Attributes:
        advantage: a key of ``ADVANTAGES`` (``grpo``, ``grpo_no_std``, ``rloo``) or of
            ``TOKEN_ADVANTAGES`` (``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``).
        adv_eps: added to the group std of ``grpo``.
        gamma: discount of the REINFORCE++ and GAE returns (1: the plain sum of the rewards to come).
        lam: GAE's lambda (``advantage: gae``, PPO with a critic; 1: Monte Carlo, 0: one-step TD).
        kl_ctrl: PPO's KL-in-reward coefficient, fixed or adaptive (:class:`~mindspeed_rl.ppo_sections.KLControlConfig`).
        use_kl_in_reward: fold ``-kl_in_reward_coef * kl(policy, reference)`` into the per-token
            reward (REINFORCE++, verl's ``use_kl_in_reward``) instead of a KL term in the loss;
            the loss's ``kl_coef`` then defaults to 0, and setting it > 0 as well is an error.
        kl_in_reward_coef: beta of the KL in the reward.
        kl_in_reward_estimator: a key of ``KL_ESTIMATORS`` (default ``k1``, verl's ``kl``).
        norm_length: the constant divisor of ``loss_agg_mode: seq-mean-token-sum-norm``
            (Dr. GRPO; default ``rollout.max_new_tokens``).
        loss: a key of ``POLICY_LOSSES`` (``ppo_clip``, ``dapo``).
        clip_eps_low, clip_eps_high, clip_ratio_c, loss_agg_mode, kl_coef, kl_estimator,
        entropy_coef, ratio_level, tis_cap: see :class:`~mindspeed_rl.algorithms.PolicyLossConfig`.
        dynamic_sampling: drop groups whose rewards are all equal and generate more (DAPO).
        dynamic_sampling_max_rounds: give up after this many generation rounds per step.
        overlong_buffer: DAPO's soft overlong punishment over the last this many tokens before
            ``rollout.max_new_tokens`` (default: off).
        overlong_penalty_factor: the penalty at the maximum length.
    """

    advantage: str = "grpo"
    adv_eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    use_kl_in_reward: bool = False
    kl_in_reward_coef: float = 0.001
    kl_in_reward_estimator: str = "k1"
    norm_length: int | None = None
    loss: str = "ppo_clip"
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    clip_ratio_c: float | None = None
    loss_agg_mode: str | None = None
    kl_coef: float | None = None
    kl_estimator: str | None = None
    entropy_coef: float | None = None
    ratio_level: Literal["token", "sequence"] | None = None
    tis_cap: float | None = None
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 10
    overlong_buffer: int | None = None
    overlong_penalty_factor: float = 1.0

    def loss_config(self) -> PolicyLossConfig:
        """The policy loss settings: the loss's defaults with the keys set here."""
        names = (
            "clip_eps_low",
            "clip_eps_high",
            "clip_ratio_c",
            "loss_agg_mode",
            "kl_coef",
            "kl_estimator",
            "entropy_coef",
            "ratio_level",
            "tis_cap",
        )
        overrides = {name: getattr(self, name) for name in names}
        if self.use_kl_in_reward and self.kl_coef is None:  # the KL is in the reward: not twice
            overrides["kl_coef"] = 0.0
        return policy_loss_config(self.loss, **overrides)

    def kl_in_reward(self) -> bool:
        """Whether the per-token reward carries a KL penalty (``use_kl_in_reward`` with beta > 0)."""
        return self.use_kl_in_reward and self.kl_in_reward_coef > 0

    def needs_reference(self) -> bool:
        """Whether a reference policy is needed (a KL penalty, in the loss or the reward, with beta > 0)."""
        return self.loss_config().kl_coef > 0 or self.kl_in_reward()


@dataclass
class BufferConfig:
    """The replay buffer between rollout and training.

    Attributes:
        mode: ``sync`` (on-policy: the trainer only sees rows of its current version) or
            ``async`` (the rollout runs ahead by at most ``max_staleness`` versions).
        max_staleness: default 0 for sync, 1 for async.
    """

    mode: Literal["sync", "async"] = "sync"
    max_staleness: int | None = None

    def staleness(self) -> int:
        """The effective bound."""
        return self.max_staleness if self.max_staleness is not None else (0 if self.mode == "sync" else 1)


@dataclass
class DataConfig:
    """Prompts.

    Attributes:
        path: a .jsonl/.json/.parquet file, or ``demo`` (the shipped arithmetic set).
        eval_path: held-out prompts for evaluation (``demo-test`` for the shipped split).
        map_keys: ``prompt`` / ``reference`` -> field names (default ``question`` / ``answer``).
        prompt_format: ``chat`` (the tokenizer's chat template) or ``plain`` (``prompt_template``).
        prompt_template: the plain format, with a ``{prompt}`` placeholder.
        instruction: appended to every prompt.
        system: a system message (chat format).
        shuffle: draw prompts in a seeded random order.
    """

    path: str = "demo"
    eval_path: str | None = None
    map_keys: dict[str, str] = field(default_factory=dict)
    prompt_format: Literal["chat", "plain"] = "chat"
    prompt_template: str = "Question: {prompt}\nAnswer:"
    instruction: str = ""
    system: str | None = None
    shuffle: bool = True


@dataclass
class RayConfig:
    """Where the workers run.

    Attributes:
        address: an existing Ray cluster (default: a local instance).
        num_cpus: CPUs of the local instance (default: all).
    """

    address: str | None = None
    num_cpus: int | None = None


@dataclass
class TrainConfig:
    """Steps and batches.

    Attributes:
        steps: GRPO steps (rollout + update).
        global_batch: prompts per step (each sampled ``rollout.n`` times).
        seed: seeds the prompt order, the sampling and the weights of a fresh model.
        eval_interval: evaluate on ``data.eval_path`` every this many steps, and before the first
            step and after the last (default: never).
        eval_temperature: sampling temperature of the evaluation (0: greedy).
        eval_n: responses per held-out prompt (with ``eval_temperature`` > 0; seeded, the same
            seeds at every evaluation, so the evaluations of a run are comparable).
        exit_duration_mins: stop after this many minutes (megatron's ``--exit-duration-in-mins``):
            the current step finishes, a checkpoint is saved and the command exits 0; the same
            command resumes.
        max_nonfinite_steps: stop after this many consecutive actor updates (optimizer steps) with a
            NaN/Inf loss or gradient norm (each is skipped before the optimizer applies it: no
            update, no schedule step); exit status 1, as the LLM trainer's key of the same name.
    """

    steps: int = 100
    global_batch: int = 8
    seed: int = 1234
    eval_interval: int | None = None
    eval_temperature: float = 0.0
    eval_n: int = 1
    exit_duration_mins: float | None = None
    max_nonfinite_steps: int = 3


@dataclass
class LoggingConfig(CoreLoggingConfig):
    """The core's ``logging`` section (:class:`mindspeed.metrics.config.LoggingConfig`: dir, interval,
    progress, trackers and their settings) plus RL's curve.

    Attributes:
        reward_curve: draw ``reward.png`` at the end.
    """

    reward_curve: bool = True


@dataclass
class CheckpointConfig:
    """Checkpoints of the whole run (actor, optimizer, prompt order, buffer version).

    Attributes:
        save: directory of the checkpoints (default: none are written).
        interval: save every this many steps (default: only at the end).
        keep_last: keep only this many newest complete checkpoints (default: all).
        resume: continue from the newest complete checkpoint in ``save`` (damaged newer ones are
            skipped with a warning); a ``save`` holding checkpoints but no complete one is an
            error unless this is false.
        save_hf: write the final policy as a Hugging Face directory here.
        save_hf_dtype: dtype of the ``save_hf`` tensors: auto (the dtype the actor was trained
            in), float32, bfloat16 or float16; its config.json always says the dtype written.
        override_scheduler: on resume, when the actor's learning-rate schedule (``actor.lr``,
            ``min_lr``, ``lr_warmup_steps``, ``lr_decay_style``, ``weight_decay``, and the decay
            length that ``train.steps`` sets) differs from the checkpoint's, the recipe wins: the
            schedule goes on from the resumed update with the recipe's values (megatron's
            ``--override-opt_param-scheduler``). A difference with neither this nor
            ``use_checkpoint_scheduler`` is an error that lists it.
        use_checkpoint_scheduler: on resume, the checkpoint's schedule wins over a different one
            in the recipe (megatron's ``--use-checkpoint-opt_param-scheduler``).
    """

    save: str | None = None
    interval: int | None = None
    keep_last: int | None = None
    resume: bool = True
    save_hf: str | None = None
    save_hf_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    override_scheduler: bool = False
    use_checkpoint_scheduler: bool = False


class RecipeSections(Protocol):
    """What the checks read of a recipe: its sections (a :class:`~mindspeed_rl.config.GRPOConfig`)."""

    actor: ActorConfig
    rollout: RolloutConfig
    reference: ReferenceConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    buffer: BufferConfig
    data: DataConfig
    ray: RayConfig
    train: TrainConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    features: FeaturesConfig
