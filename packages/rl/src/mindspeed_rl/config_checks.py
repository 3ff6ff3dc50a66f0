"""The checks behind :meth:`mindspeed_rl.config.GRPOConfig.check` (kept apart to keep files short).

They read the recipe's sections only (:class:`~mindspeed_rl.sections.RecipeSections`), so this
module does not import :mod:`mindspeed_rl.config`.

Each check raises :class:`~mindspeed.config.ConfigError` with the key, the value and the fix.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mindspeed.checkpointing.schedule import check_scheduler_flags
from mindspeed.config import ConfigError
from mindspeed_rl.algorithms.advantages import ADVANTAGES
from mindspeed_rl.algorithms.gae import VALUE_ADVANTAGES
from mindspeed_rl.algorithms.kl import KL_ESTIMATORS
from mindspeed_rl.algorithms.losses import POLICY_LOSSES
from mindspeed_rl.algorithms.reinforce import TOKEN_ADVANTAGES
from mindspeed_rl.data.prompts import DEFAULT_MAP_KEYS, PromptFormat, resolve_data_path
from mindspeed_rl.ppo_checks import check_gae_keys
from mindspeed_rl.rewards.base import build_reward
from mindspeed_rl.sections import AlgorithmConfig, RecipeSections

_AT_LEAST_ONE = {
    "actor": ("tp", "pp", "dp", "micro_batch_size", "ppo_epochs"),
    "rollout": ("n", "max_prompt_length", "max_new_tokens", "tp", "max_num_seqs"),
    "reward": ("model_batch_size",),
    "algorithm": ("dynamic_sampling_max_rounds",),
    "train": ("steps", "global_batch"),
}
_OPTIONAL_AT_LEAST_ONE = {
    "actor": ("max_tokens_per_micro_batch", "mini_batch_size"),
    "rollout": ("num_devices",),
    "ray": ("num_cpus",),
    "train": ("eval_interval",),
    "checkpoint": ("interval", "keep_last"),
}


def _check_counts(config: RecipeSections) -> None:
    for section, keys in _AT_LEAST_ONE.items():
        for key in keys:
            value = getattr(getattr(config, section), key)
            if value < 1:
                raise ConfigError(f"{section}.{key}={value} must be at least 1")
    for section, keys in _OPTIONAL_AT_LEAST_ONE.items():
        for key in keys:
            value = getattr(getattr(config, section), key)
            if value is not None and value < 1:
                raise ConfigError(f"{section}.{key}={value} must be at least 1 (or unset)")


def _check_model_dir(key: str, path: str | None, required: bool, what: str) -> None:
    if path is None:
        if required:
            raise ConfigError(f"{key} is required: {what}")
        return
    if not Path(path).exists():
        raise ConfigError(f"{key}={path!r} does not exist: {what}")


def _check_actor(config: RecipeSections, num_devices: int | None) -> None:
    a, r, t = config.actor, config.rollout, config.train
    _check_model_dir(
        "actor.model",
        a.model,
        True,
        "give a Hugging Face model directory or a Megatron checkpoint, e.g. actor.model=/models/Qwen2.5-0.5B-Instruct",
    )
    if a.tokenizer not in (None, "demo"):
        _check_model_dir("actor.tokenizer", a.tokenizer, True, "give a tokenizer directory, demo, or leave it unset")
    if not a.lr > 0:
        raise ConfigError(f"actor.lr={a.lr} must be positive; give a learning rate such as actor.lr=1e-6")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(a, key) < 1:
            raise ConfigError(f"actor.{key}={getattr(a, key)} must be in [0, 1), e.g. 0.9")
    if not 0 <= a.min_lr <= a.lr:
        raise ConfigError(f"need 0 <= actor.min_lr <= actor.lr (got {a.min_lr} and {a.lr})")
    if t.max_nonfinite_steps < 0:
        raise ConfigError(f"train.max_nonfinite_steps={t.max_nonfinite_steps} must not be negative")
    if a.lr_warmup_steps < 0 or (a.lr_warmup_steps and a.lr_warmup_steps >= t.steps):
        raise ConfigError(f"actor.lr_warmup_steps={a.lr_warmup_steps} must be in [0, train.steps={t.steps})")
    if a.clip_grad < 0 or a.weight_decay < 0:
        raise ConfigError(f"actor.clip_grad={a.clip_grad} and actor.weight_decay={a.weight_decay} must be >= 0")
    mini = a.mini_batch_size or t.global_batch
    if t.global_batch % mini:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by actor.mini_batch_size={mini}; "
            "use a divisor (one optimizer update per mini-batch)"
        )
    rows = mini * r.n
    if rows % a.dp:
        raise ConfigError(
            f"a mini-batch of {mini} prompts x rollout.n={r.n} = {rows} responses does not split "
            f"over actor.dp={a.dp} ranks; change train.global_batch, actor.mini_batch_size or rollout.n"
        )
    per_rank = rows // a.dp
    if a.max_tokens_per_micro_batch is None and per_rank % a.micro_batch_size:
        raise ConfigError(
            f"{per_rank} responses per rank and mini-batch are not divisible by actor.micro_batch_size="
            f"{a.micro_batch_size}; change it or set actor.max_tokens_per_micro_batch"
        )
    longest = r.max_prompt_length + r.max_new_tokens
    if a.max_tokens_per_micro_batch is not None and a.max_tokens_per_micro_batch < longest:
        raise ConfigError(
            f"actor.max_tokens_per_micro_batch={a.max_tokens_per_micro_batch} is below the longest "
            f"sequence (rollout.max_prompt_length + rollout.max_new_tokens = {longest}); raise it"
        )
    if a.max_tokens_per_micro_batch is not None:
        raise ConfigError(
            "actor.max_tokens_per_micro_batch (micro-batches balanced by tokens) is not supported by the "
            "actor yet; unset it and size actor.micro_batch_size instead"
        )
    if a.share_prompt and a.pp > 1:
        raise ConfigError(
            f"actor.share_prompt=true needs actor.pp=1 (got {a.pp}: pipeline stages exchange fixed-shape "
            "microbatches); set actor.share_prompt=false or leave it unset"
        )
    world = config.actor.world_size()
    if r.colocate:
        if world % r.tp:
            raise ConfigError(
                f"rollout.tp={r.tp} must divide the actor's {world} devices (actor.tp x pp x dp) it "
                "shares; change rollout.tp or set rollout.colocate=false"
            )
        if r.num_devices is not None:
            raise ConfigError(
                "rollout.num_devices is for a separated rollout pool; unset it or set rollout.colocate=false"
            )
    else:
        if r.num_devices is None:
            raise ConfigError("rollout.colocate=false needs rollout.num_devices (the rollout pool's size)")
        if r.num_devices % r.tp:
            raise ConfigError(f"rollout.num_devices={r.num_devices} is not a multiple of rollout.tp={r.tp}")
    needed = world + (0 if r.colocate else r.num_devices or 0)
    if num_devices is not None and needed > num_devices:
        raise ConfigError(
            f"the layout needs {needed} devices (actor.tp x pp x dp = {world}"
            f"{'' if r.colocate else f' + rollout.num_devices = {r.num_devices}'}) but {num_devices} "
            "are available; shrink the layout"
        )


def _check_rollout(config: RecipeSections) -> None:
    r = config.rollout
    if r.stop:
        raise ConfigError(
            f"rollout.stop={r.stop!r}: stop strings are not supported by the rollout engines yet; "
            "responses end at the tokenizer's EOS or rollout.max_new_tokens: unset rollout.stop"
        )
    if r.n < 2 and config.algorithm.advantage not in VALUE_ADVANTAGES:  # GAE's baseline is the critic
        raise ConfigError(
            f"rollout.n={r.n}: group-relative advantages compare several responses per prompt; "
            "set rollout.n >= 2 (e.g. 8)"
        )
    if r.temperature <= 0:
        raise ConfigError(
            f"rollout.temperature={r.temperature} must be positive (RL needs sampling, not greedy decoding)"
        )
    if not 0 < r.top_p <= 1 or r.top_k < 0:
        raise ConfigError(f"need 0 < rollout.top_p <= 1 and rollout.top_k >= 0 (got {r.top_p}, {r.top_k})")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]")
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm but vllm is not installed: install mindspeed-rl[vllm] (vllm-ascend on "
            "Ascend) or set rollout.engine=builtin"
        )


def _check_kl_in_reward(al: AlgorithmConfig) -> None:
    if not 0 < al.gamma <= 1:
        raise ConfigError(f"algorithm.gamma={al.gamma} must be in (0, 1]")
    if al.norm_length is not None and al.norm_length < 1:
        raise ConfigError(f"algorithm.norm_length={al.norm_length} must be a positive number of tokens")
    if not al.use_kl_in_reward:
        return
    if al.advantage not in TOKEN_ADVANTAGES and al.advantage not in VALUE_ADVANTAGES:
        raise ConfigError(
            f"algorithm.use_kl_in_reward needs a token-level advantage (one of "
            f"{', '.join(map(str, TOKEN_ADVANTAGES.keys()))}), not {al.advantage!r}; set algorithm.advantage "
            "or use the loss's KL (algorithm.kl_coef) instead"
        )
    if al.kl_in_reward_coef < 0:
        raise ConfigError(f"algorithm.kl_in_reward_coef={al.kl_in_reward_coef} must be >= 0")
    if al.kl_in_reward_estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"algorithm.kl_in_reward_estimator={al.kl_in_reward_estimator!r}; use one of "
            f"{', '.join(map(str, KL_ESTIMATORS.keys()))}"
        )
    if al.kl_coef:
        raise ConfigError(
            f"algorithm.use_kl_in_reward with algorithm.kl_coef={al.kl_coef} counts the KL twice (in the reward "
            "and in the loss); set algorithm.kl_coef=0 or algorithm.use_kl_in_reward=false"
        )


def _check_algorithm(config: RecipeSections) -> None:
    al, r = config.algorithm, config.rollout
    known = [*ADVANTAGES.keys(), *TOKEN_ADVANTAGES.keys(), *VALUE_ADVANTAGES.keys()]
    if al.advantage not in known:
        raise ConfigError(f"algorithm.advantage={al.advantage!r}; use one of {', '.join(map(str, known))}")
    check_gae_keys(al, has_critic=getattr(config, "critic", None) is not None)
    _check_kl_in_reward(al)
    if al.loss not in POLICY_LOSSES:
        raise ConfigError(f"algorithm.loss={al.loss!r}; use one of {', '.join(map(str, POLICY_LOSSES.keys()))}")
    try:
        config.algorithm.loss_config().validate()
    except ValueError as err:
        raise ConfigError(f"algorithm: {err}") from err
    if al.adv_eps < 0 or al.overlong_penalty_factor < 0:
        raise ConfigError(
            f"algorithm.adv_eps={al.adv_eps} and algorithm.overlong_penalty_factor="
            f"{al.overlong_penalty_factor} must be >= 0"
        )
    if al.overlong_buffer is not None and not 0 < al.overlong_buffer <= r.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer={al.overlong_buffer} must be in (0, rollout.max_new_tokens={r.max_new_tokens}]"
        )
    if config.reference.model is not None and not config.algorithm.needs_reference():
        raise ConfigError(
            "reference.model is set but the KL coefficient is 0 (no reference is used); set "
            "algorithm.kl_coef > 0 or unset reference.model"
        )
    if config.algorithm.needs_reference():
        _check_model_dir(
            "reference.model",
            config.reference.model,
            False,
            "give the reference weights or unset it (default: actor.model)",
        )


def _check_buffer(config: RecipeSections) -> None:
    b = config.buffer
    if b.max_staleness is not None and b.max_staleness < 0:
        raise ConfigError(f"buffer.max_staleness={b.max_staleness} must be >= 0")
    if b.mode == "sync" and b.staleness() != 0:
        raise ConfigError(
            f"buffer.mode=sync is on-policy: buffer.max_staleness={b.max_staleness} must be 0; "
            "set buffer.mode=async to let the rollout run ahead"
        )
    if b.mode == "async" and b.staleness() == 0:
        raise ConfigError(
            "buffer.mode=async with buffer.max_staleness=0 is synchronous; set buffer.max_staleness >= 1 "
            "or buffer.mode=sync"
        )
    if not config.reference.colocate:
        raise ConfigError(
            "reference.colocate=false (a reference on its own devices) is not supported yet; the reference "
            "shares the actor's workers: set reference.colocate=true (reference.offload keeps its weights "
            "in host memory between uses)"
        )
    if b.mode == "async" and config.rollout.colocate:
        raise ConfigError(
            "buffer.mode=async needs the rollout on its own devices (it generates while the actor "
            "trains): set rollout.colocate=false and rollout.num_devices"
        )


def _check_reward(config: RecipeSections) -> None:
    rw = config.reward
    if not rw.verifiers and rw.model is None:
        raise ConfigError("no reward: set reward.verifiers (e.g. [math]) and/or reward.model")
    if rw.weights is not None and len(rw.weights) != len(rw.verifiers):
        raise ConfigError(
            f"reward.weights has {len(rw.weights)} entries for {len(rw.verifiers)} reward.verifiers; "
            "give one weight per verifier"
        )
    if any(not isinstance(v, dict) for v in rw.options.values()):
        raise ConfigError(
            "reward.options maps a verifier name to a mapping of its options, e.g. {format: {preset: think}}"
        )
    try:
        build_reward(rw.verifiers, rw.weights, rw.options)
    except ValueError as err:
        raise ConfigError(f"reward: {err}") from err
    if rw.model is not None and not (Path(rw.model) / "config.json").is_file():
        raise ConfigError(f"reward.model={rw.model!r} is not a Hugging Face model directory (no config.json)")


def _check_data(config: RecipeSections) -> None:
    d = config.data
    for key in ("path", "eval_path"):
        value = getattr(d, key)
        if value is not None:
            try:
                resolve_data_path(value)
            except ValueError as err:
                raise ConfigError(f"data.{key}: {err}") from err
    unknown = sorted(set(d.map_keys) - set(DEFAULT_MAP_KEYS))
    if unknown:
        raise ConfigError(
            f"data.map_keys: unknown key(s) {', '.join(unknown)}; map prompt and reference, e.g. "
            "{prompt: problem, reference: solution}"
        )
    try:
        PromptFormat(d.prompt_format, d.prompt_template, d.instruction, d.system)
    except ValueError as err:
        raise ConfigError(f"data.prompt_template: {err}") from err
    t = config.train
    if t.eval_interval is not None and d.eval_path is None:
        raise ConfigError("train.eval_interval needs data.eval_path (e.g. demo-test)")
    if t.eval_temperature < 0 or t.eval_n < 1:
        raise ConfigError(f"train.eval_temperature={t.eval_temperature} must be >= 0 and train.eval_n={t.eval_n} >= 1")
    if t.eval_n > 1 and t.eval_temperature == 0:
        raise ConfigError(
            f"train.eval_n={t.eval_n} with greedy evaluation (train.eval_temperature=0) repeats the same "
            "response; set train.eval_temperature > 0 (e.g. 1.0) or train.eval_n=1"
        )


def check_config(config: RecipeSections, num_devices: int | None = None) -> None:
    """Run every check (see :meth:`GRPOConfig.check`)."""
    _check_counts(config)
    config.logging.check()
    check_scheduler_flags(config.checkpoint.override_scheduler, config.checkpoint.use_checkpoint_scheduler)
    _check_rollout(config)
    _check_actor(config, num_devices)
    _check_algorithm(config)
    _check_buffer(config)
    _check_reward(config)
    _check_data(config)
