"""The sections of a GRPO recipe: one dataclass per section of the YAML file, each with the
check of its own values.

``train``, ``checkpoint`` and ``logging`` are the core's sections (:mod:`mindspeed.training_config`,
:mod:`mindspeed.checkpointing.config`, :mod:`mindspeed.metrics.config`), extended with RL's keys
where RL needs more. :class:`~mindspeed_rl.config.grpo.GRPOConfig` holds one of each; the checks of the
sections against each other (:mod:`mindspeed_rl.config.checks`) read them through
:class:`RecipeSections`, so neither module imports the other's recipe class.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from mindspeed.checkpointing.config import CheckpointConfig
from mindspeed.compile import compile_mode
from mindspeed.config import ConfigError, recipe_section
from mindspeed.features import FeaturesConfig
from mindspeed.log import get_logger
from mindspeed.metrics.config import LoggingConfig
from mindspeed.training_config import TrainConfig
from mindspeed_rl.algorithms.advantages import ADVANTAGES
from mindspeed_rl.algorithms.gae import VALUE_ADVANTAGES
from mindspeed_rl.algorithms.kl import KL_ESTIMATORS
from mindspeed_rl.algorithms.losses import POLICY_LOSSES, PolicyLossConfig, policy_loss_config
from mindspeed_rl.algorithms.reinforce import TOKEN_ADVANTAGES
from mindspeed_rl.config.lora import RLLoraConfig
from mindspeed_rl.config.ppo_sections import KL_COEF_DEFAULT, KLControlConfig
from mindspeed_rl.data.prompts import DEFAULT_MAP_KEYS, PromptFormat, resolve_data_path
from mindspeed_rl.rewards.base import build_reward

logger = get_logger(__name__)

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
        compile: ``torch.compile`` each megatron ``TransformerLayer`` of the actor and of its frozen
            reference (the LLM suite's ``train.compile``: regional, one graph for the layers, packed
            microbatches of any length through one graph; compiled in the first update and log-prob
            pass; ``docs/rl/benchmark.md``). ``true``/``default`` or ``max-autotune``; tp/pp 1.
        offload_optimizer: co-location: optimizer state to host memory while the rollout generates.
        offload_grad: co-location: gradients to host memory while the rollout generates.
        lora: LoRA RL (``mindspeed-llm sft``'s ``lora`` keys: ``target_modules``, ``r``, ``alpha``,
            ``dropout``, ``save_peft``): only the adapters train, the reference is the actor with
            its adapters off, the rollout engine gets the merged weights (docs/rl/lora.md).
        model_type: ``llm`` (megatron-core through the LLM suite) or ``vlm`` (a vision-language model
            of ``mindspeed_mm``, prompts with images in mllm_format: docs/rl/vlm.md).
        ulysses_parallel_size: ``model_type: vlm`` only: ranks of the Ulysses sequence-parallel group
            that shares each packed microbatch (``mindspeed-mm``'s ``parallel.ulysses_parallel_size``;
            ``mindspeed-rl grpo --nproc-per-node`` starts them).
        fsdp: ``model_type: vlm`` only: shard the policy with the multimodal trainer's FSDP2 plan over all
            its ranks (``actor.dp`` x ``actor.ulysses_parallel_size``); the rollout engine gets the gathered weights.
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
    compile: bool | Literal["default", "max-autotune"] = False
    offload_optimizer: bool = True
    offload_grad: bool = True
    lora: RLLoraConfig = field(default_factory=RLLoraConfig)
    model_type: Literal["llm", "vlm"] = "llm"
    ulysses_parallel_size: int = 1
    fsdp: bool = False

    def world_size(self) -> int:
        """Devices of the actor: ``tp x pp x dp``."""
        return self.tp * self.pp * self.dp

    def check(self) -> None:
        """Check the section's own values (raises ``ConfigError`` naming the key and the fix)."""
        check_counts("actor", self, ("tp", "pp", "dp", "micro_batch_size", "ppo_epochs", "ulysses_parallel_size"))
        if self.ulysses_parallel_size != 1 and self.model_type != "vlm":
            raise ConfigError(
                f"actor.ulysses_parallel_size={self.ulysses_parallel_size} is for actor.model_type=vlm; a text "
                "policy's context parallelism is not offered here, leave it at 1"
            )
        if self.fsdp and self.model_type != "vlm":
            raise ConfigError(
                "actor.fsdp is for actor.model_type=vlm (the multimodal trainer's FSDP2); a text policy shards "
                "with megatron's distributed optimizer, leave actor.fsdp at false"
            )
        check_counts("actor", self, ("max_tokens_per_micro_batch", "mini_batch_size"), optional=True)
        check_model_dir(
            "actor.model",
            self.model,
            True,
            "give a Hugging Face model directory or a Megatron checkpoint, e.g. actor.model=/models/Qwen2.5-0.5B-Instruct",
        )
        if self.tokenizer not in (None, "demo"):
            check_model_dir(
                "actor.tokenizer", self.tokenizer, True, "give a tokenizer directory, demo, or leave it unset"
            )
        if not self.lr > 0:
            raise ConfigError(f"actor.lr={self.lr} must be positive; give a learning rate such as actor.lr=1e-6")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"actor.{key}={getattr(self, key)} must be in [0, 1), e.g. 0.9")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"need 0 <= actor.min_lr <= actor.lr (got {self.min_lr} and {self.lr})")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ConfigError(
                f"actor.clip_grad={self.clip_grad} and actor.weight_decay={self.weight_decay} must be >= 0"
            )
        if self.share_prompt and self.pp > 1:
            raise ConfigError(
                f"actor.share_prompt=true needs actor.pp=1 (got {self.pp}: pipeline stages exchange fixed-shape "
                "microbatches); set actor.share_prompt=false or leave it unset"
            )
        if self.compile:
            try:
                compile_mode(self.compile)
            except ValueError as error:
                raise ConfigError(str(error).replace("train.compile", "actor.compile")) from None
            if self.tp > 1 or self.pp > 1 or self.model_type != "llm" or self.lora.enabled:
                raise ConfigError(
                    f"actor.compile={self.compile} is proven for a full-weight text policy at tp=1, pp=1 (got "
                    f"tp={self.tp}, pp={self.pp}, model_type={self.model_type}, lora.enabled={self.lora.enabled}); "
                    "set actor.compile=false"
                )
        self.lora.check()


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
        compile: the ``builtin`` engine runs its decode step under ``torch.compile`` (one graph per
            batch bucket, compiled in the first rollout; dense models; off by default: see
            docs/llm/generate.md for when it pays).
        stop: strings that end a response.
        tools: tool names a multi-turn rollout offers (``mindspeed_rl.tools.TOOLS``: ``calculator``,
            ``python``); empty: single-turn rollouts.
        tool_options: tool name -> its options (e.g. ``{python: {wall_timeout_s: 5}}``).
        max_turns: assistant turns per sample at most (with ``tools``).
        max_response_length: response tokens per sample, generated and tool tokens together
            (with ``tools``; default ``max_turns * max_new_tokens``); ``max_new_tokens`` bounds each turn.
        max_parallel: tool calls run at once. tool_timeout_s: wall seconds per tool call.
        tool_overlap: run a sample's tool calls while the others generate, and start its next turn
            when its results are back (the ``builtin`` engine; on Ray the loop and the tools run in
            the rollout workers); false, and with vLLM: a barrier per turn. The samples are the
            same either way.
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
    compile: bool = False
    stop: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    tool_options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 1
    max_response_length: int | None = None
    max_parallel: int = 4
    tool_timeout_s: float = 30.0
    tool_overlap: bool = True

    def response_budget(self) -> int:
        """Response tokens per sample at most (all turns and tool responses)."""
        return self.max_response_length or self.max_turns * self.max_new_tokens

    def check(self) -> None:
        """Check the section's own values (raises ``ConfigError`` naming the key and the fix)."""
        check_counts("rollout", self, ("n", "max_prompt_length", "max_new_tokens", "tp", "max_num_seqs"))
        self._check_tools()
        check_counts("rollout", self, ("num_devices",), optional=True)
        if self.stop:
            raise ConfigError(
                f"rollout.stop={self.stop!r}: stop strings are not supported by the rollout engines yet; "
                "responses end at the tokenizer's EOS or rollout.max_new_tokens: unset rollout.stop"
            )
        if self.temperature <= 0:
            raise ConfigError(
                f"rollout.temperature={self.temperature} must be positive (RL needs sampling, not greedy decoding)"
            )
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"need 0 < rollout.top_p <= 1 and rollout.top_k >= 0 (got {self.top_p}, {self.top_k})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.compile and self.engine != "builtin":
            raise ConfigError(
                f"rollout.compile=true compiles the builtin engine's decode step; rollout.engine={self.engine} "
                "compiles its own: unset rollout.compile or set rollout.engine=builtin"
            )
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.engine=vllm but vllm is not installed: install mindspeed-rl[vllm] (vllm-ascend on "
                "Ascend) or set rollout.engine=builtin"
            )
        if self.colocate and self.num_devices is not None:
            raise ConfigError(
                "rollout.num_devices is for a separated rollout pool; unset it or set rollout.colocate=false"
            )
        if not self.colocate and self.num_devices is None:
            raise ConfigError("rollout.colocate=false needs rollout.num_devices (the rollout pool's size)")
        if not self.colocate and self.num_devices % self.tp:
            raise ConfigError(f"rollout.num_devices={self.num_devices} is not a multiple of rollout.tp={self.tp}")

    def _check_tools(self) -> None:
        from mindspeed_rl.tools import TOOLS, build_tools

        check_counts("rollout", self, ("max_turns", "max_parallel"))
        check_counts("rollout", self, ("max_response_length",), optional=True)
        if not self.tool_timeout_s > 0:
            raise ConfigError(f"rollout.tool_timeout_s={self.tool_timeout_s} must be positive (seconds per tool call)")
        if not self.tools:
            if self.max_turns != 1 or self.tool_options or self.max_response_length is not None:
                raise ConfigError(
                    "rollout.max_turns, rollout.tool_options and rollout.max_response_length are for multi-turn "
                    "rollouts: set rollout.tools (e.g. [calculator]) or unset them"
                )
            return
        unknown = [name for name in self.tools if name not in TOOLS]
        if unknown:
            raise ConfigError(f"rollout.tools: unknown tool(s) {unknown}; known: {', '.join(sorted(TOOLS))}")
        if any(not isinstance(v, dict) for v in self.tool_options.values()):
            raise ConfigError("rollout.tool_options maps a tool name to a mapping of its options, e.g. {python: {}}")
        try:
            build_tools(self.tools, self.tool_options)
        except ValueError as err:
            raise ConfigError(f"rollout.tool_options: {err}") from err
        if self.response_budget() < self.max_new_tokens:
            raise ConfigError(
                f"rollout.max_response_length={self.max_response_length} is below rollout.max_new_tokens="
                f"{self.max_new_tokens} (one turn): raise it"
            )


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

    def check(self) -> None:
        """Check the section's own values (raises ``ConfigError`` naming the key and the fix)."""
        if not self.colocate:
            raise ConfigError(
                "reference.colocate=false (a reference on its own devices) is not supported yet; the reference "
                "shares the actor's workers: set reference.colocate=true (reference.offload keeps its weights "
                "in host memory between uses)"
            )


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

    def check(self) -> None:
        """Check the verifiers, their options and the reward model (raises ``ConfigError`` naming the key)."""
        check_counts("reward", self, ("model_batch_size",))
        if not self.verifiers and self.model is None:
            raise ConfigError("no reward: set reward.verifiers (e.g. [math]) and/or reward.model")
        if self.weights is not None and len(self.weights) != len(self.verifiers):
            raise ConfigError(
                f"reward.weights has {len(self.weights)} entries for {len(self.verifiers)} reward.verifiers; "
                "give one weight per verifier"
            )
        if any(not isinstance(v, dict) for v in self.options.values()):
            raise ConfigError(
                "reward.options maps a verifier name to a mapping of its options, e.g. {format: {preset: think}}"
            )
        try:
            build_reward(self.verifiers, self.weights, self.options)
        except ValueError as err:
            raise ConfigError(f"reward: {err}") from err
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"reward.model={self.model!r} is not a Hugging Face model directory (no config.json)")


@dataclass
class AlgorithmConfig:
    """Advantages, policy loss and DAPO's extras. Loss settings left unset take the loss's defaults.

    Attributes:
        advantage: a key of ``ADVANTAGES`` (``grpo``, ``grpo_no_std``, ``rloo``) or of
            ``TOKEN_ADVANTAGES`` (``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``).
        adv_eps: added to the group std of ``grpo``.
        gamma: discount of the REINFORCE++ and GAE returns (1: the plain sum of the rewards to come).
        lam: GAE's lambda (``advantage: gae``, PPO with a critic; 1: Monte Carlo, 0: one-step TD).
        kl_ctrl: the KL-in-reward coefficient ``kl_ctrl.kl_coef`` (verl's spelling), fixed or, for
            PPO, adaptive (:class:`~mindspeed_rl.config.ppo_sections.KLControlConfig`).
        use_kl_in_reward: fold ``-kl_ctrl.kl_coef * kl(policy, reference)`` into the per-token
            reward (REINFORCE++, PPO; verl's ``use_kl_in_reward``) instead of a KL term in the loss;
            the loss's ``kl_coef`` then defaults to 0, and setting it > 0 as well is an error.
        kl_in_reward_coef: the old spelling of ``kl_ctrl.kl_coef``: still read (its value moves
            there, with one warning line), ``None`` once loaded.
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
    kl_in_reward_coef: float | None = None
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

    def __post_init__(self) -> None:
        # One coefficient, one key: the old spelling moves to kl_ctrl.kl_coef (verl's) with one line.
        old = self.kl_in_reward_coef
        if old is None:
            return
        k = self.kl_ctrl
        if k.kl_coef != KL_COEF_DEFAULT and k.kl_coef != old:
            raise ValueError(
                f"algorithm.kl_in_reward_coef={old} and algorithm.kl_ctrl.kl_coef={k.kl_coef} set one coefficient "
                "twice; keep algorithm.kl_ctrl.kl_coef only"
            )
        logger.warning("algorithm.kl_in_reward_coef is renamed algorithm.kl_ctrl.kl_coef (verl's key); using %s", old)
        self.kl_ctrl = replace(k, kl_coef=old)
        self.kl_in_reward_coef = None

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
        return self.use_kl_in_reward and self.kl_ctrl.kl_coef > 0

    def needs_reference(self) -> bool:
        """Whether a reference policy is needed (a KL penalty, in the loss or the reward, with beta > 0)."""
        return self.loss_config().kl_coef > 0 or self.kl_in_reward()

    def check(self) -> None:
        """Check the registries' names, the loss settings and DAPO's extras (raises ``ConfigError``)."""
        check_counts("algorithm", self, ("dynamic_sampling_max_rounds",))
        self.check_advantage()
        self._check_kl_in_reward()
        if self.loss not in POLICY_LOSSES:
            raise ConfigError(f"algorithm.loss={self.loss!r}; use one of {', '.join(map(str, POLICY_LOSSES.keys()))}")
        try:
            self.loss_config().validate()
        except ValueError as err:
            raise ConfigError(f"algorithm: {err}") from err
        if self.adv_eps < 0 or self.overlong_penalty_factor < 0:
            raise ConfigError(
                f"algorithm.adv_eps={self.adv_eps} and algorithm.overlong_penalty_factor="
                f"{self.overlong_penalty_factor} must be >= 0"
            )

    def check_advantage(self) -> None:
        """Check that ``advantage`` names a registered advantage (raises ``ConfigError`` listing them)."""
        known = [*ADVANTAGES.keys(), *TOKEN_ADVANTAGES.keys(), *VALUE_ADVANTAGES.keys()]
        if self.advantage not in known:
            raise ConfigError(f"algorithm.advantage={self.advantage!r}; use one of {', '.join(map(str, known))}")

    def _check_kl_in_reward(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"algorithm.gamma={self.gamma} must be in (0, 1]")
        if self.norm_length is not None and self.norm_length < 1:
            raise ConfigError(f"algorithm.norm_length={self.norm_length} must be a positive number of tokens")
        if not self.use_kl_in_reward:
            return
        if self.advantage not in TOKEN_ADVANTAGES and self.advantage not in VALUE_ADVANTAGES:
            raise ConfigError(
                f"algorithm.use_kl_in_reward needs a token-level advantage (one of "
                f"{', '.join(map(str, TOKEN_ADVANTAGES.keys()))}), not {self.advantage!r}; set algorithm.advantage "
                "or use the loss's KL (algorithm.kl_coef) instead"
            )
        if self.kl_ctrl.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_ctrl.kl_coef={self.kl_ctrl.kl_coef} must be >= 0")
        if self.kl_in_reward_estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"algorithm.kl_in_reward_estimator={self.kl_in_reward_estimator!r}; use one of "
                f"{', '.join(map(str, KL_ESTIMATORS.keys()))}"
            )
        if self.kl_coef:
            raise ConfigError(
                f"algorithm.use_kl_in_reward with algorithm.kl_coef={self.kl_coef} counts the KL twice (in the "
                "reward and in the loss); set algorithm.kl_coef=0 or algorithm.use_kl_in_reward=false"
            )


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

    def check(self) -> None:
        """Check the bound against the mode (raises ``ConfigError`` naming the key and the fix)."""
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"buffer.max_staleness={self.max_staleness} must be >= 0")
        if self.mode == "sync" and self.staleness() != 0:
            raise ConfigError(
                f"buffer.mode=sync is on-policy: buffer.max_staleness={self.max_staleness} must be 0; "
                "set buffer.mode=async to let the rollout run ahead"
            )
        if self.mode == "async" and self.staleness() == 0:
            raise ConfigError(
                "buffer.mode=async with buffer.max_staleness=0 is synchronous; set buffer.max_staleness >= 1 "
                "or buffer.mode=sync"
            )


@recipe_section(name="DataConfig")
@dataclass
class PromptDataConfig:
    """The ``data`` section of an RL recipe: the prompts (and their references) the rollout answers.

    Attributes:
        path: a .jsonl/.json/.parquet file, or ``demo`` (the shipped arithmetic set).
        eval_path: held-out prompts for evaluation (``demo-test`` for the shipped split).
        map_keys: ``prompt`` / ``reference`` -> field names (default ``question`` / ``answer``).
        prompt_format: ``chat`` (the tokenizer's chat template) or ``plain`` (``prompt_template``).
        prompt_template: the plain format, with a ``{prompt}`` placeholder.
        instruction: appended to every prompt.
        system: a system message (chat format).
        shuffle: draw prompts in a seeded random order.
        image_min_pixels: vision-language prompts (``actor.model_type: vlm``): images are resized to at
            least this many pixels. image_max_pixels: and to at most this many (``mindspeed-mm``'s keys).
    """

    path: str = "demo"
    eval_path: str | None = None
    map_keys: dict[str, str] = field(default_factory=dict)
    prompt_format: Literal["chat", "plain"] = "chat"
    prompt_template: str = "Question: {prompt}\nAnswer:"
    instruction: str = ""
    system: str | None = None
    shuffle: bool = True
    image_min_pixels: int = 3136
    image_max_pixels: int = 262144

    def check(self) -> None:
        """Check the files, the field names and the prompt format (raises ``ConfigError`` naming the key)."""
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None:
                try:
                    resolve_data_path(value)
                except ValueError as err:
                    raise ConfigError(f"data.{key}: {err}") from err
        unknown = sorted(set(self.map_keys) - set(DEFAULT_MAP_KEYS))
        if unknown:
            raise ConfigError(
                f"data.map_keys: unknown key(s) {', '.join(unknown)}; map prompt and reference, e.g. "
                "{prompt: problem, reference: solution}"
            )
        try:
            PromptFormat(self.prompt_format, self.prompt_template, self.instruction, self.system)
        except ValueError as err:
            raise ConfigError(f"data.prompt_template: {err}") from err


#: The worker pools ``ray.pool_resources`` can pin.
POOLS = ("actor", "rollout", "critic", "reward")


@dataclass
class RayConfig:
    """Where the workers run.

    Attributes:
        address: an existing Ray cluster (``host:6379``, ``ray://host:10001``, ``auto``; default:
            ``RAY_ADDRESS``, else a local instance).
        num_cpus: CPUs of the local instance (default: all).
        pool_resources: pool (``actor``, ``rollout``, ``critic``, ``reward``) -> custom Ray
            resources each of its workers asks for, e.g. ``{actor: {trainer: 1}, rollout:
            {generator: 1}}`` to pin the pools to the nodes started with those resources
            (``ray start --resources '{"trainer": 8}'``).
    """

    address: str | None = None
    num_cpus: int | None = None
    pool_resources: dict[str, dict[str, float]] = field(default_factory=dict)

    def check(self) -> None:
        """Check the CPU count and the pools' resources (raises ``ConfigError``)."""
        check_counts("ray", self, ("num_cpus",), optional=True)
        for pool, resources in self.pool_resources.items():
            if pool not in POOLS:
                raise ConfigError(
                    f"ray.pool_resources: unknown pool {pool!r}; use {', '.join(POOLS)}, e.g. {{actor: {{trainer: 1}}}}"
                )
            if not isinstance(resources, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in resources.values()
            ):
                raise ConfigError(
                    f"ray.pool_resources.{pool}={resources!r}: give custom resource names with positive amounts "
                    "per worker, e.g. {trainer: 1}"
                )
            reserved = sorted(set(resources) & {"CPU", "GPU", "NPU", "memory", "object_store_memory"})
            if reserved:
                raise ConfigError(
                    f"ray.pool_resources.{pool} names {', '.join(reserved)}: devices and CPUs come from the "
                    "layout; give custom resources only (those of `ray start --resources`)"
                )


@recipe_section(
    name="TrainConfig",
    keys=(
        "steps",
        "global_batch",
        "seed",
        "eval_interval",
        "eval_temperature",
        "eval_n",
        "exit_duration_mins",
        "max_nonfinite_steps",
    ),
)
@dataclass
class RLTrainConfig(TrainConfig):
    """The core's ``train`` section (:class:`mindspeed.training_config.TrainConfig`: steps, seed, the
    stops) with RL's batch of prompts and evaluation.

    ``steps`` counts GRPO steps (rollout + update); ``seed`` seeds the prompt order, the sampling
    and the weights of a fresh model; ``max_nonfinite_steps`` counts consecutive actor updates
    (optimizer steps). The optimizer and its schedule are the ``actor`` section's.

    Attributes:
        global_batch: prompts per step (each sampled ``rollout.n`` times).
        eval_interval: evaluate on ``data.eval_path`` every this many steps, and before the first
            step and after the last (default: never).
        eval_temperature: sampling temperature of the evaluation (0: greedy).
        eval_n: responses per held-out prompt (with ``eval_temperature`` > 0; seeded, the same
            seeds at every evaluation, so the evaluations of a run are comparable).
    """

    global_batch: int = 8
    eval_interval: int | None = None
    eval_temperature: float = 0.0
    eval_n: int = 1

    def check(self) -> None:
        """The core's checks, the batch and the evaluation (raises ``ConfigError`` naming the key)."""
        check_counts("train", self, ("steps", "global_batch"))
        check_counts("train", self, ("eval_interval",), optional=True)
        super().check()
        if self.eval_temperature < 0 or self.eval_n < 1:
            raise ConfigError(
                f"train.eval_temperature={self.eval_temperature} must be >= 0 and train.eval_n={self.eval_n} >= 1"
            )
        if self.eval_n > 1 and self.eval_temperature == 0:
            raise ConfigError(
                f"train.eval_n={self.eval_n} with greedy evaluation (train.eval_temperature=0) repeats the same "
                "response; set train.eval_temperature > 0 (e.g. 1.0) or train.eval_n=1"
            )


@recipe_section(name="LoggingConfig")
@dataclass
class RLLoggingConfig(LoggingConfig):
    """The core's ``logging`` section (:class:`mindspeed.metrics.config.LoggingConfig`: dir, interval,
    progress, trackers and their settings) plus RL's curve.

    Attributes:
        reward_curve: draw ``reward.png`` at the end.
    """

    reward_curve: bool = True


def check_counts(section: str, values: object, keys: tuple[str, ...], optional: bool = False) -> None:
    """Raise when one of ``keys`` of ``values`` is below 1 (``optional``: unset is fine)."""
    for key in keys:
        value = getattr(values, key)
        if optional and value is None:
            continue
        if value < 1:
            raise ConfigError(f"{section}.{key}={value} must be at least 1" + (" (or unset)" if optional else ""))


def check_model_dir(key: str, path: str | None, required: bool, what: str) -> None:
    """Raise when the directory ``path`` of ``key`` is missing (``what``: the fix)."""
    if path is None:
        if required:
            raise ConfigError(f"{key} is required: {what}")
        return
    if not Path(path).exists():
        raise ConfigError(f"{key}={path!r} does not exist: {what}")


class RecipeSections(Protocol):
    """What the checks read of a recipe: its sections (a :class:`~mindspeed_rl.config.grpo.GRPOConfig`)."""

    actor: ActorConfig
    rollout: RolloutConfig
    reference: ReferenceConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    buffer: BufferConfig
    data: PromptDataConfig
    ray: RayConfig
    train: RLTrainConfig
    logging: RLLoggingConfig
    checkpoint: CheckpointConfig
    features: FeaturesConfig
