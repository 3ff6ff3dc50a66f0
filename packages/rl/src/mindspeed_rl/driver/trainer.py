"""GRPO in one process: rollout with the built-in engine, rewards, advantages, the megatron update, weight sync.

One step (:func:`grpo_step`)::

    prompts -> engine.generate (rollout.n samples each) -> rewards (verifiers) -> advantages
            -> actor old log-probs (and the frozen reference's, with a KL penalty)
            -> policy update(s) (mini-batches x ppo_epochs) -> engine.load_weights(actor.hf_state())

:func:`train_grpo` runs ``train.steps`` of them from a :class:`~mindspeed_rl.config.grpo.GRPOConfig`.
Everything runs in the calling process on its torch.distributed group (a one-rank gloo group
is started when there is none); Ray workers, co-location offload and the asynchronous buffer
come on top of these pieces.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.config import to_dict
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_llm.engine import InferenceEngine, SamplingParams
from mindspeed_rl.algorithms import (
    TOKEN_ADVANTAGES,
    DynamicSampler,
    compute_advantages,
    compute_token_advantages,
    kl_penalty,
    masked_mean,
    overlong_penalty,
)
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.sections import RLTrainConfig
from mindspeed_rl.data import PromptFormat, PromptRecord, PromptSampler, encode_prompts, load_prompts
from mindspeed_rl.driver.metrics import RLMetricsLog
from mindspeed_rl.models.actor import Actor
from mindspeed_rl.models.actor_settings import actor_settings, build_reference
from mindspeed_rl.models.memory import freeze_startup_objects
from mindspeed_rl.rewards import RewardModel, WeightedReward, build_reward
from mindspeed_rl.rollout.agent import AgentLoop, AgentSettings, agent_metrics
from mindspeed_rl.tools import build_tools

logger = get_logger(__name__)


@dataclass
class GRPOContext:
    """What a GRPO step works with.

    Attributes:
        config: the recipe.
        actor: the policy being trained.
        engine: the rollout engine (``generate``, ``load_weights``).
        tokenizer: the Hugging Face tokenizer of the policy.
        reward: the reward functions.
        records: the prompt records.
        sampler: draws ``train.global_batch`` record indices per step.
        prompt_format: how a record becomes the prompt text.
        reference: the KL reference: a frozen actor, or a LoRA actor with its adapters off (with a KL penalty).
        step: steps done.
        history: the records of the steps done.
        weight_sync: pushes the actor's weights into the engine (default: ``engine.load_weights(actor.hf_state())``).
        eval_samples: the last :func:`evaluate`'s rows (``prompt``, ``response``, ``reward``), for the trackers.
        agent: the multi-turn agent loop (with ``rollout.tools``; see :func:`build_agent`).
    """

    config: GRPOConfig
    actor: Actor
    engine: Any
    tokenizer: Any
    reward: WeightedReward
    records: list[PromptRecord]
    sampler: PromptSampler
    prompt_format: PromptFormat
    reference: Any = None
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    weight_sync: Callable[[], None] | None = None
    eval_samples: list[dict[str, Any]] = field(default_factory=list)
    agent: AgentLoop | None = None


def build_agent(config: GRPOConfig, tokenizer: Any) -> AgentLoop | None:
    """The agent loop of ``rollout.tools`` (None without tools: single-turn rollouts)."""
    r = config.rollout
    if not r.tools:
        return None
    tools = build_tools(r.tools, r.tool_options)
    settings = AgentSettings(tools, r.max_turns, r.response_budget(), r.max_parallel, r.tool_timeout_s, r.tool_overlap)
    return AgentLoop(tokenizer, settings)


def generate_responses(
    ctx: GRPOContext, prompts: list[list[int]], params: list[SamplingParams], records: list[PromptRecord]
) -> tuple[list[Any], list[str], dict[str, float]]:
    """The engine's outputs for ``prompts`` (one per row, ``records`` their prompts), the text the
    rewards read, and the rollout's metrics.

    Without tools: one generation; the text is the decoded response. With tools: the agent loop's
    :class:`~mindspeed_rl.rollout.agent.AgentOutput` (with its ``loss_mask``); the text is the last
    assistant turn (the answer), and the metrics are the tools' (:func:`agent_metrics`).
    """
    if ctx.agent is None:
        outputs = ctx.engine.generate(prompts, params)
        return outputs, [ctx.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs], {}
    conversations = [ctx.prompt_format.messages(rec.prompt) for rec in records]
    outputs = ctx.agent.run(ctx.engine, prompts, params, conversations)
    answers = [next((m["content"] for m in reversed(o.messages) if m["role"] == "assistant"), "") for o in outputs]
    return outputs, answers, agent_metrics(outputs)


def assistant_turns(ctx: GRPOContext, outputs: list[Any]) -> list[list[str]] | None:
    """Each sample's assistant turns (multi-turn rollouts; None without tools), for per-turn rewards."""
    if ctx.agent is None:
        return None
    return [[m["content"] for m in o.messages if m["role"] == "assistant"] for o in outputs]


def render_prompt(ctx: GRPOContext, record: PromptRecord) -> str:
    """A record's prompt text (with the tools' schemas when the rollout offers tools)."""
    return ctx.prompt_format.render(record.prompt, ctx.tokenizer, ctx.agent.schemas if ctx.agent else None)


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@dataclass
class RolloutBatch:
    """One step's experience: ``rollout.n`` consecutive rows per prompt.

    Attributes:
        pairs: ``(prompt ids, response ids)`` per row.
        prompts: the prompt text of each row. references: its reference answer.
        rollout_logp: per row, the engine's log-probs of the response tokens.
        rewards: ``[rows]`` total rewards. parts: each reward function's scores.
        metrics: dynamic-sampling counters and the tools' metrics (empty without them).
        loss_masks: per row, 1 on the generated response tokens and 0 on the tool responses
            (multi-turn rollouts; None: every response token is generated).
    """

    pairs: list[tuple[list[int], list[int]]]
    prompts: list[str]
    references: list[str | None]
    rollout_logp: list[torch.Tensor]
    rewards: torch.Tensor
    parts: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    loss_masks: list[torch.Tensor] | None = None

    def mask(self, width: int) -> torch.Tensor:
        """``[rows, width]``: the loss mask (ones on every response token without one), zero-padded."""
        if self.loss_masks is None:
            return _pad([torch.ones(len(r)) for _, r in self.pairs], width)
        return _pad(self.loss_masks, width)

    def select(self, groups: list[int], n: int) -> RolloutBatch:
        """The rows of the given prompt groups, in that order."""
        rows = [g * n + j for g in groups for j in range(n)]
        pick = torch.tensor(rows, dtype=torch.long)
        return RolloutBatch(
            [self.pairs[i] for i in rows],
            [self.prompts[i] for i in rows],
            [self.references[i] for i in rows],
            [self.rollout_logp[i] for i in rows],
            self.rewards[pick],
            {k: v[pick] for k, v in self.parts.items()},
            loss_masks=None if self.loss_masks is None else [self.loss_masks[i] for i in rows],
        )


def _one_round(ctx: GRPOContext, round_index: int) -> RolloutBatch:
    cfg, r, algo = ctx.config, ctx.config.rollout, ctx.config.algorithm
    chosen = [ctx.records[i] for i in ctx.sampler.next_batch()]
    texts = [render_prompt(ctx, rec) for rec in chosen]
    ids, kept = encode_prompts(
        texts, ctx.tokenizer, r.max_prompt_length, add_special_tokens=ctx.prompt_format.style == "plain"
    )
    if not ids:
        raise ValueError(
            f"every prompt of step {ctx.step + 1} is longer than rollout.max_prompt_length="
            f"{r.max_prompt_length}; raise it"
        )
    prompts = [ids[k] for k in range(len(kept)) for _ in range(r.n)]
    # Every request its own seed (step, round, row): repeatable, and different across rounds.
    base = cfg.train.seed * 1_000_003 + ctx.step * 65_537 + round_index * 4_099
    params = [
        SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=base + i
        )
        for i in range(len(prompts))
    ]
    rows = [chosen[kept[k]] for k in range(len(kept)) for _ in range(r.n)]
    outputs, responses, metrics = generate_responses(ctx, prompts, params, rows)
    pairs = [(list(p), list(o.token_ids)) for p, o in zip(prompts, outputs)]
    prompt_texts = [texts[kept[k]] for k in range(len(kept)) for _ in range(r.n)]
    references = [rec.reference for rec in rows]
    rewards, parts = ctx.reward.score_batch(prompt_texts, responses, references, assistant_turns(ctx, outputs))
    if algo.overlong_buffer:  # DAPO's soft overlong punishment, on top of the verifiers
        lengths = torch.tensor([len(resp) for _, resp in pairs], dtype=torch.float32)
        penalty = overlong_penalty(lengths, r.response_budget(), algo.overlong_buffer, algo.overlong_penalty_factor)
        parts["overlong"] = penalty
        rewards = rewards + penalty
    return RolloutBatch(
        pairs,
        prompt_texts,
        references,
        [torch.tensor(o.logprobs, dtype=torch.float32) for o in outputs],
        rewards,
        parts,
        metrics,
        [torch.tensor(o.loss_mask, dtype=torch.float32) for o in outputs] if ctx.agent is not None else None,
    )


def _mean_metrics(rounds: list[RolloutBatch]) -> dict[str, float]:
    keys = {k for b in rounds for k in b.metrics}
    return {k: sum(b.metrics.get(k, 0.0) for b in rounds) / len(rounds) for k in sorted(keys)}


def collect_rollout(ctx: GRPOContext) -> RolloutBatch:
    """Generate and score one step's experience (no actor involved).

    With ``algorithm.dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped
    and further prompt batches are generated until ``train.global_batch`` groups are kept.

    Raises:
        ValueError: no prompt fits ``rollout.max_prompt_length``.
        RuntimeError: dynamic sampling found too few groups in ``dynamic_sampling_max_rounds``.
    """
    cfg, n = ctx.config, ctx.config.rollout.n
    if not cfg.algorithm.dynamic_sampling:
        return _one_round(ctx, 0)
    sampler = DynamicSampler(cfg.train.global_batch, n, cfg.algorithm.dynamic_sampling_max_rounds)
    rounds: list[RolloutBatch] = []
    while not sampler.done:
        rounds.append(_one_round(ctx, len(rounds)))
        sampler.add(rounds[-1].rewards)
    picked = [rounds[r].select([g], n) for r, g in sampler.selection()]
    merged = RolloutBatch(
        [p for b in picked for p in b.pairs],
        [t for b in picked for t in b.prompts],
        [t for b in picked for t in b.references],
        [t for b in picked for t in b.rollout_logp],
        torch.cat([b.rewards for b in picked]),
        {k: torch.cat([b.parts[k] for b in picked]) for k in picked[0].parts},
        {**_mean_metrics(rounds), **sampler.metrics()},
        None if picked[0].loss_masks is None else [m for b in picked for m in b.loss_masks or []],
    )
    return merged


def train_on_batch(ctx: GRPOContext, batch: RolloutBatch) -> dict[str, float]:
    """Advantages, old/reference log-probs and the policy update(s) on one rollout batch (collective).

    Returns:
        The step's metrics without the rollout and weight-sync timings (see :func:`grpo_step`).
    """
    cfg = ctx.config
    n, algo = cfg.rollout.n, cfg.algorithm
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[f"time/{name}"] = now - mark
        mark = now

    pairs, rewards = batch.pairs, batch.rewards
    width = max(len(r) for _, r in pairs)
    mini = (cfg.actor.mini_batch_size or cfg.train.global_batch) * n
    # One update on the whole batch: the policy before it is the current one, so the update
    # takes the old log-probs detached from its own forward and a separate pass is skipped.
    on_policy = cfg.actor.ppo_epochs == 1 and mini >= len(pairs)
    kl_in_reward = algo.kl_in_reward()
    # The KL in the reward needs the old policy's log-probs even when the update would not.
    policy_logp = _pad(ctx.actor.compute_logprobs(pairs), width) if kl_in_reward or not on_policy else None
    old_logp = None if on_policy else policy_logp
    ref_logp = _pad(ctx.reference.compute_logprobs(pairs), width) if ctx.reference is not None else None
    lap("old_logp")
    rollout_logp = _pad(batch.rollout_logp, width)
    mask = batch.mask(width)
    extra: dict[str, float] = {}
    if algo.advantage in TOKEN_ADVANTAGES:
        token_rewards = None
        if kl_in_reward:
            assert policy_logp is not None and ref_logp is not None  # kl_in_reward needs both (checked)
            kl = kl_penalty(policy_logp, ref_logp, algo.kl_in_reward_estimator) * mask
            token_rewards = -algo.kl_ctrl.kl_coef * kl
            extra["kl_in_reward"] = float(masked_mean(kl, mask))
        advantages = compute_token_advantages(algo.advantage, rewards, mask, n, token_rewards, algo.gamma)
    else:
        advantages = compute_advantages(algo.advantage, rewards, n, eps=algo.adv_eps)
    loss_mask = None if batch.loss_masks is None else mask
    if loss_mask is not None:  # tool tokens: no advantage (and no loss: the actor multiplies the mask in too)
        advantages = (advantages if advantages.dim() == 2 else advantages[:, None]) * loss_mask
    update = update_actor(ctx, pairs, old_logp, advantages, ref_logp, rollout_logp, loss_mask)
    lap("update")
    return step_record(ctx, batch, update, times, extra, old_logp, rollout_logp, mask)


def update_actor(
    ctx: GRPOContext,
    pairs: list[tuple[list[int], list[int]]],
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
) -> dict[str, list[float]]:
    """The policy updates of one step (``actor.ppo_epochs`` x mini-batches); each update's metrics, by name.

    ``loss_mask`` (``[rows, width]``, multi-turn rollouts) is passed on only when given, so an
    actor without the argument serves single-turn runs unchanged.
    """
    cfg = ctx.config
    mini = (cfg.actor.mini_batch_size or cfg.train.global_batch) * cfg.rollout.n
    update: dict[str, list[float]] = {}
    for _ in range(cfg.actor.ppo_epochs):
        for first in range(0, len(pairs), mini):
            part = slice(first, first + mini)
            masked = {} if loss_mask is None else {"loss_mask": loss_mask[part]}
            metrics = ctx.actor.update(
                pairs[part],
                None if old_logp is None else old_logp[part],
                advantages[part],
                None if ref_logp is None else ref_logp[part],
                rollout_logp[part],
                **masked,
            )
            for key, value in metrics.items():
                update.setdefault(key, []).append(value)
    return update


def step_record(
    ctx: GRPOContext,
    batch: RolloutBatch,
    update: dict[str, list[float]],
    times: dict[str, float],
    extra: dict[str, float],
    old_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """A step's metrics from its batch and its updates (see :func:`grpo_step`)."""
    pairs, rewards, parts = batch.pairs, batch.rewards, batch.parts
    lengths = torch.tensor([float(len(r)) for _, r in pairs])
    record: dict[str, float] = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "policy_version": float(ctx.actor.version),
    }
    record.update({f"reward/{name}": float(v.mean()) for name, v in parts.items()})
    record.update(batch.metrics)
    record.update(extra)
    counts = ("update_tokens", "skipped", "nonfinite_streak")
    record.update({key: sum(v) / len(v) for key, v in update.items() if key not in counts})
    # Updates refused for a NaN/Inf loss or gradient norm: this step's, and in a row at its end.
    record["skipped_updates"] = sum(update.get("skipped", [0.0]))
    record["nonfinite_streak"] = update.get("nonfinite_streak", [0.0])[-1]
    if old_logp is not None:  # the first mini-batch's number is the one before any update of this step
        record["rollout_logp_diff"] = float(((rollout_logp - old_logp).abs() * mask).sum() / mask.sum())
    record.update(times)
    record["update_tps"] = sum(update.get("update_tokens", [0.0])) / max(times.get("time/update", 0.0), 1e-9)
    return record


def sync_weights(ctx: GRPOContext) -> None:
    """Push the actor's weights into the rollout engine (``ctx.weight_sync`` when set)."""
    if ctx.weight_sync is not None:
        ctx.weight_sync()
    else:
        ctx.engine.load_weights(ctx.actor.hf_state())


def finish_record(ctx: GRPOContext, batch: RolloutBatch, record: dict[str, float], total: float) -> dict[str, float]:
    """Add the step number, ``time/step`` and the throughputs to a step's record; keep it in the history."""
    pairs = batch.pairs
    ctx.step += 1
    record["step"] = float(ctx.step)
    record["time/step"] = total
    generated = sum(len(r) for _, r in pairs)
    record["rollout_tps"] = generated / max(record.get("time/rollout", 0.0), 1e-9)
    record["e2e_tps"] = sum(len(p) + len(r) for p, r in pairs) / max(total, 1e-9)
    ctx.history.append(record)
    return record


def grpo_step(ctx: GRPOContext) -> dict[str, float]:
    """One GRPO step (collective over the actor's group).

    Returns:
        Metrics: ``reward_mean``/``reward_std`` (and per reward function), ``response_length``,
        the update's loss metrics (``loss``, ``pg_clipfrac``, ``kl_loss``, ...; a MoE policy's
        ``load_balancing_loss`` / ``z_loss``; each averaged over the step's updates), ``rollout_logp_diff``
        (mean |engine - actor| log-prob of the samples: the sync's health), ``time/<phase>``
        seconds and ``rollout_tps``, ``update_tps``, ``e2e_tps`` (tokens per second).

    Raises:
        ValueError: no prompt fits ``rollout.max_prompt_length``.
    """
    start = time.perf_counter()
    batch = collect_rollout(ctx)
    rollout_time = time.perf_counter() - start  # generation and the verifiers (which are cheap next to it)
    record = train_on_batch(ctx, batch)
    record["time/rollout"] = rollout_time
    mark = time.perf_counter()
    sync_weights(ctx)
    record["time/weight_sync"] = time.perf_counter() - mark
    return finish_record(ctx, batch, record, time.perf_counter() - start)


def evaluate(ctx: GRPOContext, records: list[PromptRecord]) -> dict[str, float]:
    """The rollout engine's responses to held-out prompts, scored by the run's rewards.

    Greedy by default; ``train.eval_temperature`` > 0 samples ``train.eval_n`` responses per
    prompt with seeds fixed for the run (and the rollout's ``top_k`` / ``top_p``).

    Returns:
        ``eval/reward_mean`` (and ``eval/reward/<fn>`` per reward function) and
        ``eval/response_length`` over the prompts that fit ``rollout.max_prompt_length``.

    Raises:
        ValueError: no held-out prompt fits ``rollout.max_prompt_length``.
    """
    r = ctx.config.rollout
    texts = [render_prompt(ctx, rec) for rec in records]
    ids, kept = encode_prompts(
        texts, ctx.tokenizer, r.max_prompt_length, add_special_tokens=ctx.prompt_format.style == "plain"
    )
    if not ids:
        raise ValueError(f"no held-out prompt fits rollout.max_prompt_length={r.max_prompt_length}; raise it")
    t = ctx.config.train
    n = t.eval_n if t.eval_temperature > 0 else 1
    # The same seeds at every evaluation of a run: their differences are the policy's, not the dice's.
    params = [
        SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=t.eval_temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            seed=t.seed * 7_919 + i,
        )
        for i in range(len(ids) * n)
    ]
    rows = [k for k in kept for _ in range(n)]
    outputs, responses, metrics = generate_responses(
        ctx, [p for p in ids for _ in range(n)], params, [records[k] for k in rows]
    )
    rewards, parts = ctx.reward.score_batch(
        [texts[k] for k in rows], responses, [records[k].reference for k in rows], assistant_turns(ctx, outputs)
    )
    ctx.eval_samples = [
        {"prompt": texts[k], "response": response, "reward": float(reward)}
        for k, response, reward in zip(rows, responses, rewards.tolist())
    ]
    out = {
        "eval/reward_mean": float(rewards.mean()),
        "eval/response_length": sum(len(o.token_ids) for o in outputs) / len(outputs),
    }
    out.update({f"eval/reward/{name}": float(v.mean()) for name, v in parts.items()})
    out.update({f"eval/{name}": value for name, value in metrics.items()})
    return out


def eval_due(step: int, train: RLTrainConfig) -> bool:
    """Whether the held-out set is evaluated after ``step``: every ``train.eval_interval`` steps and after the last."""
    interval = train.eval_interval
    return interval is not None and (step % interval == 0 or step == train.steps)


def _ensure_group() -> None:
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = get_accelerator().dist_backend
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def prompt_pieces(
    config: GRPOConfig, reward_model: Any = None
) -> tuple[list[PromptRecord], PromptSampler, PromptFormat, WeightedReward]:
    """The prompt records, their sampler, the prompt format and the reward functions of a recipe.

    Args:
        config: the recipe.
        reward_model: the scorer of ``reward.model`` (anything with ``score_batch``; default: a
            local :class:`~mindspeed_rl.rewards.RewardModel` on the host CPU when the recipe names one).
    """
    d, r = config.data, config.reward
    records = load_prompts(d.path, d.map_keys or None)
    sampler = PromptSampler(len(records), config.train.global_batch, config.train.seed, d.shuffle)
    fmt = PromptFormat(style=d.prompt_format, template=d.prompt_template, instruction=d.instruction, system=d.system)
    extra, weights = {}, r.weights
    if r.model is not None:
        if reward_model is None:
            reward_model = RewardModel(r.model, device="cpu", batch_size=r.model_batch_size)
        extra = {"model": reward_model}
        weights = [*(r.weights or [1.0] * len(r.verifiers)), r.model_weight]
    return records, sampler, fmt, build_reward(r.verifiers, weights, r.options, extra)


def build_context(config: GRPOConfig) -> GRPOContext:
    """Actor, reference, rollout engine, tokenizer, reward and prompts of a recipe (collective).

    Raises:
        ConfigError / ValueError: the recipe's first problem (see :meth:`GRPOConfig.check`).
    """
    from transformers import AutoTokenizer

    config.check()
    if config.actor.model_type != "llm":
        raise ValueError(
            f"actor.model_type={config.actor.model_type}: build_context builds text policies; use "
            "mindspeed_rl.driver.vlm_trainer.train_vlm_grpo"
        )
    _ensure_group()
    a = config.actor
    settings = actor_settings(config)
    actor = Actor(a.model, settings, tp=a.tp, pp=a.pp, features=config.features)
    reference = build_reference(config, actor, a.model)
    engine = InferenceEngine.from_pretrained(
        a.model, max_batch_size=config.rollout.max_num_seqs, compile=config.rollout.compile
    )
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    records, sampler, fmt, reward = prompt_pieces(config)
    ctx = GRPOContext(config, actor, engine, tokenizer, reward, records, sampler, fmt, reference)
    ctx.agent = build_agent(config, tokenizer)
    return ctx


def train_grpo(config: GRPOConfig) -> list[dict[str, float]]:
    """Run ``train.steps`` GRPO steps of ``config`` in this process.

    Returns:
        The metrics of every step (see :func:`grpo_step`); with a log directory
        (:meth:`GRPOConfig.log_dir`) also sent to ``logging.trackers`` (``metrics.jsonl`` one
        line a step, TensorBoard, ...) through :class:`~mindspeed_rl.driver.metrics.RLMetricsLog`,
        as the Ray driver does; the held-out evaluation of the starting policy is step 0.
    """
    ctx = build_context(config)
    freeze_startup_objects()
    held_out = load_prompts(config.data.eval_path, config.data.map_keys or None) if config.train.eval_interval else []
    sink: RLMetricsLog | None = None
    try:
        # logging.trackers (metrics.jsonl, TensorBoard, wandb, ...) on rank 0, as the Ray driver writes them.
        rank0 = torch.distributed.get_rank() == 0
        sink = RLMetricsLog(
            config.log_dir(), reward_curve=False, settings=config.logging, config=to_dict(config), enabled=rank0
        )
        if held_out:  # the starting policy, as step 0
            start = {"step": 0.0, **evaluate(ctx, held_out)}
            logger.info("step 0: held-out reward %.3f", start["eval/reward_mean"])
            sink.log(start)
        for _ in range(config.train.steps):
            record = grpo_step(ctx)
            if held_out and eval_due(ctx.step, config.train):
                record.update(evaluate(ctx, held_out))
            sink.log(record)
            if ctx.step % max(config.logging.interval, 1) == 0:
                logger.info(
                    "step %d: reward %.3f +- %.3f, length %.1f, loss %.4g, %.2f s",
                    ctx.step,
                    record["reward_mean"],
                    record["reward_std"],
                    record["response_length"],
                    record.get("loss", float("nan")),
                    record["time/step"],
                )
        if config.actor.lora.save_peft:
            ctx.actor.export_peft(config.actor.lora.save_peft)
    finally:
        if sink is not None:
            sink.close()
        ctx.actor.close()  # undo the adaptation of megatron-core (the reference shares it)
        gc.unfreeze()  # what the run built may be collected again
    return ctx.history
