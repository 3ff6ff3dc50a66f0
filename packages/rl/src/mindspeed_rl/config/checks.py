"""The checks of a GRPO recipe's sections against each other, behind
:meth:`mindspeed_rl.config.grpo.GRPOConfig.check` (each section checks its own values first:
``ActorConfig.check``, ``RolloutConfig.check`` ... in :mod:`mindspeed_rl.config.sections`).

They read the recipe's sections only (:class:`~mindspeed_rl.config.sections.RecipeSections`), so this
module does not import :mod:`mindspeed_rl.config.grpo`.

Each check raises :class:`~mindspeed.config.ConfigError` with the key, the value and the fix.
"""

from __future__ import annotations

from mindspeed.config import ConfigError
from mindspeed_rl.algorithms.gae import VALUE_ADVANTAGES
from mindspeed_rl.config.ppo_checks import check_gae_keys
from mindspeed_rl.config.sections import RecipeSections, check_model_dir


def _check_advantage(config: RecipeSections) -> None:
    """The rollout's group size and PPO's keys against the advantage (and whether the recipe has a critic)."""
    r, al = config.rollout, config.algorithm
    if r.n < 2 and al.advantage not in VALUE_ADVANTAGES:  # GAE's baseline is the critic
        raise ConfigError(
            f"rollout.n={r.n}: group-relative advantages compare several responses per prompt; "
            "set rollout.n >= 2 (e.g. 8)"
        )
    al.check_advantage()
    check_gae_keys(al, has_critic=getattr(config, "critic", None) is not None)


def _check_batches(config: RecipeSections) -> None:
    """The actor's schedule and batches against the train section and the rollout's group size."""
    a, r, t = config.actor, config.rollout, config.train
    if a.lr_warmup_steps < 0 or (a.lr_warmup_steps and a.lr_warmup_steps >= t.steps):
        raise ConfigError(f"actor.lr_warmup_steps={a.lr_warmup_steps} must be in [0, train.steps={t.steps})")
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
    # A vision-language actor packs up to micro_batch_size rows per forward, the last pack holding the rest.
    if a.model_type != "vlm" and a.max_tokens_per_micro_batch is None and per_rank % a.micro_batch_size:
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


def _check_placement(config: RecipeSections, num_devices: int | None) -> None:
    """The rollout and the buffer against the actor's devices and the devices the cluster offers."""
    r, world = config.rollout, config.actor.world_size()
    if r.colocate and world % r.tp:
        raise ConfigError(
            f"rollout.tp={r.tp} must divide the actor's {world} devices (actor.tp x pp x dp) it "
            "shares; change rollout.tp or set rollout.colocate=false"
        )
    needed = world + (0 if r.colocate else r.num_devices or 0)
    if num_devices is not None and needed > num_devices:
        raise ConfigError(
            f"the layout needs {needed} devices (actor.tp x pp x dp = {world}"
            f"{'' if r.colocate else f' + rollout.num_devices = {r.num_devices}'}) but {num_devices} "
            "are available; shrink the layout"
        )
    if config.buffer.mode == "async" and r.colocate:
        raise ConfigError(
            "buffer.mode=async needs the rollout on its own devices (it generates while the actor "
            "trains): set rollout.colocate=false and rollout.num_devices"
        )
    pinned = config.ray.pool_resources
    critic = getattr(config, "critic", None)
    own_pool = {
        "rollout": not r.colocate,
        "critic": critic is not None and not critic.colocate,
        "reward": config.reward.model is not None,
    }
    for pool, exists in own_pool.items():
        if pool in pinned and not exists:
            raise ConfigError(
                f"ray.pool_resources.{pool}: this recipe has no separate {pool} pool (co-located or unused); "
                f"remove the entry or give the {pool} its own workers"
            )


def _check_algorithm(config: RecipeSections) -> None:
    """DAPO's overlong buffer against the response length; the reference against the KL penalty."""
    al, r = config.algorithm, config.rollout
    if al.overlong_buffer is not None and not 0 < al.overlong_buffer <= r.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer={al.overlong_buffer} must be in (0, rollout.max_new_tokens={r.max_new_tokens}]"
        )
    if config.reference.model is not None and not al.needs_reference():
        raise ConfigError(
            "reference.model is set but the KL coefficient is 0 (no reference is used); set "
            "algorithm.kl_coef > 0 or unset reference.model"
        )
    if al.needs_reference():
        check_model_dir(
            "reference.model",
            config.reference.model,
            False,
            "give the reference weights or unset it (default: actor.model)",
        )


def check_config(config: RecipeSections, num_devices: int | None = None) -> None:
    """Run every check (see :meth:`GRPOConfig.check`): each section's own, then the cross-section ones."""
    for section in (config.actor, config.rollout, config.reward):
        section.check()
    _check_advantage(config)  # before the algorithm's own checks: PPO's keys name the fix first
    for section in (
        config.algorithm,
        config.train,
        config.ray,
        config.checkpoint,
        config.logging,
        config.buffer,
        config.reference,
        config.data,
    ):
        section.check()
    if config.actor.lora.enabled and config.reference.model not in (None, config.actor.model):
        raise ConfigError(
            f"reference.model={config.reference.model} with actor.lora: the reference is the actor with its "
            "adapters off (the base model); unset reference.model"
        )
    _check_batches(config)
    _check_placement(config, num_devices)
    _check_algorithm(config)
    if config.train.eval_interval is not None and config.data.eval_path is None:
        raise ConfigError("train.eval_interval needs data.eval_path (e.g. demo-test)")
    if config.rollout.tools and config.data.prompt_format != "chat":
        raise ConfigError(
            "rollout.tools needs data.prompt_format=chat (the chat template renders the tools and their "
            "results); set data.prompt_format=chat with a tokenizer whose template renders tool messages"
        )
