"""Vision-language GRPO on the launcher's ranks (``actor.model_type: vlm``): the GRPO step of
:mod:`mindspeed_rl.driver.trainer` with a ``mindspeed_mm`` policy.

One step::

    image questions (mllm_format) -> VisionRolloutEngine.generate (rollout.n samples each, KV cache)
        -> rule rewards on the answer -> train_on_batch (the GRPO advantages, old / reference
        log-probs and the registered policy loss, as for a text policy) -> weights to the engine

Only the rollout differs from the text path: prompts are conversations with images, encoded as the
multimodal trainer encodes them (:class:`~mindspeed_rl.rollout.vlm.VisionPrompt`). The actor is a
:class:`~mindspeed_rl.models.vlm_actor.VisionActor`; the engine is a second copy of the model in the
same process (weights copied after every update; ``rollout_logp_diff`` in the metrics says they match).

Ranks: ``actor.dp`` data-parallel replicas x ``actor.ulysses_parallel_size`` (a Ulysses group each).
Every rank draws the same questions (the sampler's seed is the run's) and encodes them all; each
data-parallel rank generates and scores its contiguous share of the step's requests (every request
its own seed, so the replies do not depend on the sharding) and the replies, their log-probs and
rewards are gathered, so every rank holds the whole batch: the advantages, the metrics and the loss
normalisation are the whole batch's, as on one rank, and the actor trains on its share of each
mini-batch (:class:`~mindspeed_rl.models.vlm_actor.VisionActor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import Preemption, StopRequest, fault_point
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_llm.engine import SamplingParams
from mindspeed_mm.inference.prompts import Prompt, read_prompt_file
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.vlm import check_vlm
from mindspeed_rl.data import PromptFormat, PromptSampler
from mindspeed_rl.demo.vlm_model import resolve_vlm_names
from mindspeed_rl.driver.trainer import GRPOContext, RolloutBatch, eval_due, finish_record, train_on_batch
from mindspeed_rl.driver.vlm_checkpoint import export_vlm, resume_vlm, save_due, save_vlm_checkpoint
from mindspeed_rl.models.vlm_actor import VisionActor, VisionActorSettings, dp_share
from mindspeed_rl.rewards import build_reward
from mindspeed_rl.rollout.vlm import VisionOutput, VisionPrompt, VisionRolloutEngine

logger = get_logger(__name__)


def resolve_vlm_config(config: GRPOConfig) -> GRPOConfig:
    """The recipe with the demo names replaced (``actor.model: demo``, ``data.path: demo``, ``data.eval_path: demo-heldout``)."""
    a, d = config.actor, config.data
    model, path, eval_path = resolve_vlm_names(a.model, d.path, d.eval_path)
    return replace(config, actor=replace(a, model=model), data=replace(d, path=path, eval_path=eval_path))


def vision_actor_settings(config: GRPOConfig) -> VisionActorSettings:
    """The actor's optimizer, batching and loss from a recipe."""
    a, algo = config.actor, config.algorithm
    return VisionActorSettings(
        lr=a.lr,
        weight_decay=a.weight_decay,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        clip_grad=a.clip_grad,
        micro_batch_size=a.micro_batch_size,
        loss=algo.loss,
        loss_config=replace(algo.loss_config(), norm_length=algo.norm_length or config.rollout.max_new_tokens),
        seed=config.train.seed,
    )


def question(prompt: Prompt) -> str:
    """The text a reward reads as the prompt: the last user turn."""
    return prompt.messages[-1]["content"]


def read_vlm_prompts(path: str) -> list[Prompt]:
    """The image questions of an mllm_format file, each with its reference answer (the last assistant turn)."""
    prompts = read_prompt_file(path)
    missing = [p.source for p in prompts if p.reference is None]
    if missing:
        raise ValueError(f"{missing[0]}: no reference answer (an assistant turn after the question); add one")
    return prompts


def build_vlm_context(
    config: GRPOConfig, group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None
) -> GRPOContext:
    """Actor, reference (with a KL penalty), engine, rewards and prompts of a vision-language recipe.

    ``group``: the Ulysses sequence-parallel group the actor and reference split their forwards over;
    ``dp_group``: the data-parallel group the rollouts and the mini-batches are shared over.

    Raises:
        ConfigError / ValueError: the recipe's first problem.
    """
    config.check()
    check_vlm(config)
    a, d = config.actor, config.data
    settings = vision_actor_settings(config)
    actor = VisionActor(a.model, settings, group=group, dp_group=dp_group, fsdp=a.fsdp)
    reference = (
        VisionActor(config.reference.model or a.model, settings, trainable=False, group=group, dp_group=dp_group)
        if config.needs_reference()
        else None
    )
    engine = VisionRolloutEngine(a.model, d.image_min_pixels, d.image_max_pixels, config.rollout.max_num_seqs)
    engine.load_weights(actor.hf_state())
    records = read_vlm_prompts(d.path)
    sampler = PromptSampler(len(records), config.train.global_batch, config.train.seed, d.shuffle)
    reward = build_reward(config.reward.verifiers, config.reward.weights, config.reward.options)
    fmt = PromptFormat(style="chat")
    return GRPOContext(config, actor, engine, engine.tokenizer, reward, records, sampler, fmt, reference)  # type: ignore[arg-type]


def encoded(ctx: GRPOContext, prompt: Prompt, cache: dict[str, VisionPrompt]) -> VisionPrompt:
    """The prompt's tokens and vision inputs (encoded once per source line)."""
    key = f"{prompt.source}|{prompt.images}"
    if key not in cache:
        cache[key] = ctx.engine.encode(prompt)
    return cache[key]


@dataclass
class SharedRollout:
    """The replies to every row of a batch (:func:`generate_shared`), their text and rewards."""

    outputs: list[VisionOutput]
    texts: list[str]
    rewards: torch.Tensor
    parts: dict[str, torch.Tensor]


def generate_shared(
    ctx: GRPOContext, rows: list[Prompt], prompts: list[VisionPrompt], params: list[SamplingParams]
) -> SharedRollout:
    """Each data-parallel rank generates and scores its share of the rows; every rank returns all of them.

    The rows' seeds are their own (the engine samples each row from its own stream), so the replies are
    the ones one rank generating every row gets. Without a data-parallel group: all rows here.
    """
    group = ctx.actor.dp_group
    share = dp_share(len(rows), group)
    outputs = ctx.engine.generate(prompts[share], params[share]) if share.stop > share.start else []
    texts = [ctx.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    mine = rows[share]
    rewards, parts = (
        ctx.reward.score_batch([question(p) for p in mine], texts, [p.reference for p in mine])
        if mine
        else (torch.zeros(0), {})
    )
    if group is None:
        return SharedRollout(outputs, texts, rewards, parts)
    local = (
        [(o.token_ids, o.logprobs) for o in outputs],
        texts,
        rewards.tolist(),
        {k: v.tolist() for k, v in parts.items()},
    )
    shares: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, local, group=group)
    names = next((list(s[3]) for s in shares if s[3]), [])
    return SharedRollout(
        [VisionOutput(list(t), list(lp)) for s in shares for t, lp in s[0]],
        [text for s in shares for text in s[1]],
        torch.tensor([v for s in shares for v in s[2]], dtype=rewards.dtype),
        {k: torch.tensor([v for s in shares for v in s[3].get(k, [])], dtype=rewards.dtype) for k in names},
    )


def vlm_round(ctx: GRPOContext, cache: dict[str, VisionPrompt]) -> RolloutBatch:
    """Generate and score one step's experience: ``train.global_batch`` questions x ``rollout.n`` answers.

    Every rank encodes every question of the step (the actor trains on any row of a mini-batch); the
    data-parallel ranks share the generation and the scoring (:func:`generate_shared`).
    """
    cfg, r = ctx.config, ctx.config.rollout
    chosen = [ctx.records[i] for i in ctx.sampler.next_batch()]
    rows = [p for p in chosen for _ in range(r.n)]
    prompts = [encoded(ctx, p, cache) for p in rows]
    base = cfg.train.seed * 1_000_003 + ctx.step * 65_537
    params = [
        SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=base + i
        )
        for i in range(len(prompts))
    ]
    done = generate_shared(ctx, rows, prompts, params)
    outputs, rewards, parts = done.outputs, done.rewards, done.parts
    questions, references = [question(p) for p in rows], [p.reference for p in rows]
    return RolloutBatch(
        [(p, list(o.token_ids)) for p, o in zip(prompts, outputs)],
        questions,
        references,
        [torch.tensor(o.logprobs, dtype=torch.float32) for o in outputs],
        rewards,
        parts,
    )


def vlm_step(ctx: GRPOContext, cache: dict[str, VisionPrompt]) -> dict[str, float]:
    """One GRPO step; its metrics (as :func:`mindspeed_rl.driver.trainer.grpo_step`'s)."""
    start = time.perf_counter()
    batch = vlm_round(ctx, cache)
    rollout_time = time.perf_counter() - start
    record = train_on_batch(ctx, batch)
    record["time/rollout"] = rollout_time
    mark = time.perf_counter()
    ctx.engine.load_weights(ctx.actor.hf_state())
    record["time/weight_sync"] = time.perf_counter() - mark
    return finish_record(ctx, batch, record, time.perf_counter() - start)


def evaluate_vlm(ctx: GRPOContext, prompts: list[Prompt], cache: dict[str, VisionPrompt]) -> dict[str, float]:
    """The engine's answers to held-out questions scored by the run's rewards (``eval/reward_mean``: the accuracy).

    Greedy by default; ``train.eval_temperature`` > 0 samples ``train.eval_n`` answers each, seeds fixed for the run.
    """
    r, t = ctx.config.rollout, ctx.config.train
    n = t.eval_n if t.eval_temperature > 0 else 1
    rows = [p for p in prompts for _ in range(n)]
    params = [
        SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=t.eval_temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            seed=t.seed * 7_919 + i,
        )
        for i in range(len(rows))
    ]
    share = dp_share(len(rows), ctx.actor.dp_group)  # a rank encodes only the questions it answers
    inputs = [encoded(ctx, p, cache) if share.start <= i < share.stop else VisionPrompt() for i, p in enumerate(rows)]
    done = generate_shared(ctx, rows, inputs, params)
    outputs, texts, rewards, parts = done.outputs, done.texts, done.rewards, done.parts
    ctx.eval_samples = [
        {"prompt": question(p), "response": text, "reward": float(v)}
        for p, text, v in zip(rows, texts, rewards.tolist())
    ]
    out = {
        "eval/reward_mean": float(rewards.mean()),
        "eval/response_length": sum(len(o.token_ids) for o in outputs) / len(outputs),
    }
    out.update({f"eval/reward/{name}": float(v.mean()) for name, v in parts.items()})
    return out


@dataclass
class VisionRun:
    """A vision-language GRPO run, built (and resumed) but not yet stepped.

    Attributes:
        ctx: the GRPO context (``ctx.step``: the step the run resumes after, 0 for a new run).
        held_out: the held-out questions (empty without ``train.eval_interval``).
        cache: the encoded prompts, by source line.
        resumed_from: the checkpoint the run continues from (None: a new run).
        stopped: why :func:`run_vlm_steps` stopped before ``train.steps`` (a signal, the time limit; None: it did not).
    """

    ctx: GRPOContext
    held_out: list[Prompt]
    cache: dict[str, VisionPrompt] = field(default_factory=dict)
    resumed_from: Path | None = None
    stopped: StopRequest | None = None


def start_vlm_run(
    config: GRPOConfig, group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None
) -> VisionRun:
    """Build the run of ``config`` (demo names resolved) and resume it from ``checkpoint.save``'s newest checkpoint.

    ``group``: this rank's Ulysses group, ``dp_group``: its data-parallel group (every rank runs this).
    With ``checkpoint.save`` or ``checkpoint.save_hf`` it must run inside a process group (``mindspeed.launch``).
    """
    config = resolve_vlm_config(config)
    ctx = build_vlm_context(config, group, dp_group)
    c = config.checkpoint
    if (c.save or c.save_hf) and not dist.is_initialized():
        raise ValueError(
            "checkpoint.save / checkpoint.save_hf need a process group; run through mindspeed-rl grpo "
            "(or mindspeed.launch.launch)"
        )
    resumed = resume_vlm(ctx) if c.save else None
    held_out = read_vlm_prompts(str(config.data.eval_path)) if config.train.eval_interval else []
    return VisionRun(ctx, held_out, resumed_from=resumed)


def run_vlm_steps(
    run: VisionRun, on_step: Any = None, on_samples: Any = None, preemption: Preemption | None = None
) -> list[dict[str, float]]:
    """Step ``run`` to ``train.steps``, saving as ``checkpoint.save`` / ``interval`` say, then ``checkpoint.save_hf``.

    Args:
        run: from :func:`start_vlm_run`.
        on_step: called with each record (a new run's held-out evaluation of the starting policy first, as step 0).
        on_samples: called with ``(step, rows)`` after each held-out evaluation (``prompt``, ``response``, ``reward``).
        preemption: SIGTERM / Ctrl-C / ``train.exit_duration_mins``: after the step under way the run
            saves (unless that step is saved already), sets ``run.stopped`` and returns (no ``save_hf``).

    Returns:
        The metrics of the steps this call ran.
    """
    ctx, held_out, cache = run.ctx, run.held_out, run.cache
    config = ctx.config
    report = on_step or (lambda record: None)
    samples = on_samples or (lambda step, rows: None)
    if held_out and ctx.step == 0:
        start = {"step": 0.0, **evaluate_vlm(ctx, held_out, cache)}
        logger.info("step 0: held-out reward %.3f", start["eval/reward_mean"])
        report(start)
        samples(0, ctx.eval_samples)
    saved = ctx.step if run.resumed_from is not None else None
    while ctx.step < config.train.steps:
        stop = preemption.agree(ctx.actor.all_group, get_accelerator().device()) if preemption is not None else None
        if stop is not None:
            run.stopped = stop
            if config.checkpoint.save and saved != ctx.step and ctx.step > 0:
                save_vlm_checkpoint(ctx)
            return ctx.history
        record = vlm_step(ctx, cache)
        if held_out and eval_due(ctx.step, config.train):
            record.update(evaluate_vlm(ctx, held_out, cache))
        if save_due(ctx):
            save_vlm_checkpoint(ctx)
            saved = ctx.step
        report(record)
        if "eval/reward_mean" in record:
            samples(ctx.step, ctx.eval_samples)
        log_step(ctx, record)
        fault_point("rl.step_end", ctx.step)  # the reliability tests' SIGTERM / SIGKILL at the end of a step
    if config.checkpoint.save_hf:
        export_vlm(ctx)
    return ctx.history


def log_step(ctx: GRPOContext, record: dict[str, float]) -> None:
    """One console line every ``logging.interval`` steps."""
    if ctx.step % max(ctx.config.logging.interval, 1) == 0:
        logger.info(
            "step %d: reward %.3f, length %.1f, loss %.4g, %.2f s",
            ctx.step,
            record["reward_mean"],
            record["response_length"],
            record.get("loss", float("nan")),
            record["time/step"],
        )


def train_vlm_grpo(config: GRPOConfig, on_step: Any = None, on_samples: Any = None) -> list[dict[str, float]]:
    """Run ``train.steps`` vision-language GRPO steps of ``config`` in this process (:func:`start_vlm_run`,
    :func:`run_vlm_steps`); returns the metrics of the steps run."""
    return run_vlm_steps(start_vlm_run(config), on_step, on_samples)
