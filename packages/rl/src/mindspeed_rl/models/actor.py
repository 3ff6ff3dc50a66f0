"""The GRPO actor: a megatron-core policy on the current torch.distributed group.

The actor is built from a Hugging Face directory through the LLM suite's build sequence
(:func:`mindspeed_llm.engine.build_engine`, the one the LLM ``Trainer`` builds with), never a
recipe: the model from its shape and a parallel layout (``hf_model_shape``,
``build_transformer_config``, ``load_hf_weights``), the optimizer from an
:class:`~mindspeed_llm.engine.OptimizerConfig`, the schedule from a
:class:`~mindspeed_llm.engine.SchedulerConfig` and a step count. What stays here is RL's:
packing (:mod:`mindspeed_rl.models.actor_packing`), log-probs, the policy loss and the update
(:mod:`mindspeed_rl.models.actor_update`), the weight export (:mod:`mindspeed_rl.models.actor_parallel`) and
co-location memory (:mod:`mindspeed_rl.models.actor_memory`). Sequences are
``(prompt ids, response ids)`` pairs packed into THD microbatches; megatron's GPTModel with
``labels`` returns the per-token cross-entropy, so the log-prob of a response token is minus
that output. The policy loss is a megatron ``LossFunc`` that gathers the response tokens of
each sequence into ``[sequences, max response length]`` and calls the registered
:func:`~mindspeed_rl.algorithms.compute_policy_loss` with ``num_tokens=1`` / ``num_seqs=1``:
the loss is then a *sum* (over tokens, or over sequences), returned with its count, and with
``calculate_per_token_loss`` megatron divides the gradients by the count of the whole step:
the gradients of the global batch's aggregated loss, however it is split into microbatches.

When the update wants the policy's entropy (``compute_entropy``, or an entropy bonus), the model
runs without labels and the loss computes log-probs and entropy from the logits: on one
tensor-parallel rank without padding columns and without an entropy bonus by the fused head
(:mod:`mindspeed_rl.models.logp_head`: the entropy a metric without gradient), else from the
vocab-parallel logits of the response positions (:mod:`mindspeed_rl.models.actor_parallel`).
Shared prompts need the logits too; ``compute_logprobs`` otherwise keeps megatron's fused
cross-entropy unless the embedding has padding rows.

Co-location (:meth:`Actor.offload` / :meth:`Actor.onload`): the optimizer state, the DDP
gradient buffers and the weights can move to host memory while a rollout engine uses the
device (:mod:`mindspeed_rl.models.memory`). Calls that need them bring them back themselves:
``update`` onloads everything, ``compute_logprobs`` / ``hf_state`` / ``forward_logits`` only
the weights (the optimizer state and gradients stay on the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import SkipCounter
from mindspeed.compile import CompileWatch, compile_mode
from mindspeed.device import get_accelerator
from mindspeed.features import FeaturesConfig, ParallelSizes
from mindspeed.log import get_logger
from mindspeed.megatron import AdaptReport, adapt, current_report, fast_path, unadapt
from mindspeed.model.shape import ModelShape
from mindspeed_llm.engine import (
    BuildSpec,
    CheckpointConfig,
    LoraSettings,
    OptimizerConfig,
    ParallelConfig,
    PretrainConfig,
    SchedulerConfig,
    apply_lora,
    build_engine,
    build_transformer_config,
    default_groups,
    hf_model_shape,
    load_hf_weights,
    model_facts,
    packed_seq_params,
    padded_vocab_size,
    read_hf_shape,
    seed_everything,
    unwrap,
    uses_dualpipev,
)
from mindspeed_rl.algorithms.losses import PolicyLossConfig
from mindspeed_rl.models.actor_lora import ActorLora
from mindspeed_rl.models.actor_memory import OFFLOAD_CATEGORIES, ActorMemory
from mindspeed_rl.models.actor_packing import Pair, pack_microbatches, resolve_share_prompt
from mindspeed_rl.models.actor_parallel import broadcast_from_stage, gather_hf_state, vocab_parallel_logp_entropy
from mindspeed_rl.models.actor_update import UPDATE_METRICS, ActorUpdate
from mindspeed_rl.models.logp_head import packed_logp_entropy
from mindspeed_rl.models.memory import StorageOffloader

logger = get_logger(__name__)

__all__ = ["OFFLOAD_CATEGORIES", "UPDATE_METRICS", "Actor", "ActorSettings"]


@dataclass
class ActorSettings:
    """Optimizer, schedule and batching settings of the actor.

    Attributes:
        optimizer: the LLM suite's optimizer section (AdamW; its step kernel: ``kernel``, else the
            ``fused_adamw`` feature's choice of the actor's ``features``).
        scheduler: the LLM suite's schedule section (``constant``, ``linear`` or ``cosine``; one
            position per update; the decay ends at ``lr_decay_steps``, default: the warmup + 1).
        precision: ``fp32`` or ``bf16`` (bf16 weights with fp32 master weights).
        micro_batch_size: sequences per microbatch. seed: megatron's seed.
        loss: a key of ``POLICY_LOSSES``. loss_config: its settings (default: the loss's).
        compute_entropy: report the policy's mean token entropy in ``update`` (costs the
            logits of the response positions; an entropy bonus computes it regardless).
        share_prompt: pack the pairs of a microbatch that share their prompt as one segment
            ``[prompt, r_1, ..., r_G]`` (the prompt runs once; :mod:`mindspeed_rl.models.actor_packing`).
            None: on where the layout and the model allow it (pp = 1, rope or learned positions,
            no MLA or MTP, mindspeed's registry attention); True: on, or a ``ValueError`` naming
            what prevents it; False: each pair on its own.
        max_nonfinite_steps: the limit of updates refused in a row for a NaN/Inf loss or gradient
            norm that :attr:`Actor.skips` names in its lines (the driver stops the run there:
            ``train.max_nonfinite_steps``).
        lora: LoRA RL (a trainable actor only): the LLM suite's LoRA on these megatron linears,
            only the factors train (:mod:`mindspeed_rl.models.actor_lora`); None: every weight trains.
        compile: ``torch.compile`` each ``TransformerLayer`` (``mindspeed_llm.training.compile``:
            ``True``/``"default"`` or ``"max-autotune"``; False: eager). The packed microbatches'
            token count is dynamic in the graph: one graph serves every microbatch length (one more
            for the log-prob passes without gradients).
    """

    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-6, min_lr=1e-6, weight_decay=0.0, adam_beta2=0.999)
    )
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(lr=1e-6, min_lr=1e-6, lr_decay_style="constant", weight_decay=0.0)
    )
    precision: str = "fp32"
    micro_batch_size: int = 4
    seed: int = 1234
    loss: str = "ppo_clip"
    loss_config: PolicyLossConfig | None = None
    compute_entropy: bool = True
    share_prompt: bool | None = None
    max_nonfinite_steps: int = 3
    lora: LoraSettings | None = None
    compile: bool | str = False

    @classmethod
    def adamw(
        cls,
        lr: float = 1e-6,
        min_lr: float | None = None,
        lr_warmup_steps: int = 0,
        lr_decay_style: str = "constant",
        lr_decay_steps: int | None = None,
        weight_decay: float = 0.0,
        clip_grad: float = 1.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        **settings: Any,
    ) -> ActorSettings:
        """Settings of an AdamW actor whose schedule goes from ``lr`` to ``min_lr`` (default ``lr``).

        Args:
            lr, min_lr, lr_warmup_steps, lr_decay_style, lr_decay_steps, weight_decay: the schedule.
            clip_grad, adam_beta1, adam_beta2: the optimizer.
            **settings: the other fields (``precision``, ``micro_batch_size``, ``loss`` ...).
        """
        floor = lr if min_lr is None else min_lr
        optimizer = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=floor,
            weight_decay=weight_decay,
            adam_beta1=adam_beta1,
            adam_beta2=adam_beta2,
            clip_grad=clip_grad,
        )
        scheduler = SchedulerConfig(
            lr=lr,
            min_lr=floor,
            lr_warmup_steps=lr_warmup_steps,
            lr_decay_style=lr_decay_style,
            lr_decay_steps=lr_decay_steps,
            weight_decay=weight_decay,
        )
        return cls(optimizer=optimizer, scheduler=scheduler, **settings)


def _ensure_megatron(
    shape: ModelShape,
    parallel: ParallelConfig,
    seed: int,
    features: FeaturesConfig,
    world: int,
    compiled: bool = False,
    lora: bool = False,
) -> tuple[AdaptReport, bool, Any]:
    """Adapt megatron-core with ``features`` and initialise its parallel state, once per process.

    Returns:
        The adaptation (its kernels and config fields go to the builders), whether this call
        made it (the actor that adapted undoes it in :meth:`Actor.close`), and megatron's
        process groups as one value (read once here; the actor passes them on).

    Raises:
        ValueError: megatron-core is already adapted in this process with other features.
    """
    from megatron.core import parallel_state as ps

    report, made = current_report(), False
    if report is None:  # adapt() refuses a second call: the first actor of the process adapts for all
        p = parallel
        # The memory features check the precision, the layer count and the optimizer against these.
        facts = model_facts(
            build_transformer_config(shape, parallel, per_token_loss=True),
            shape,
            "bf16" if shape.params_dtype == "bfloat16" else "fp32",
            parallel.distributed_optimizer,
            compiled_layers=compiled,  # compiled layers: no gradient_accumulation_fusion (its in-place backward)
            lora=lora,  # the dualpipev feature refuses LoRA
        )
        sizes = ParallelSizes(tp=p.tp, pp=p.pp, dp=max(1, world // (p.tp * p.pp)))
        report, made = adapt(features=features, model=facts, parallel=sizes), True
    elif report.features_config != features:
        raise ValueError(
            f"megatron-core is already adapted in this process with features {report.features_config}, "
            f"not {features}; build every actor of a process with the same features section "
            "(or close() the actor that adapted first)"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp)
        seed_everything(seed, default_groups())
    return report, made, default_groups()


def _load_and_adapt(chunks: list[Any], load: Any, lora: LoraSettings | None) -> None:
    """Load the base weights into the bare chunks, then add LoRA (before DDP wraps them)."""
    load(chunks)
    if lora is not None:
        for chunk in chunks:
            apply_lora(chunk, lora)


class Actor(ActorUpdate, ActorMemory, ActorLora):
    """A megatron-core policy (or a frozen reference) built from a Hugging Face directory.

    Args:
        hf_dir: the Hugging Face model directory.
        settings: optimizer/batching settings.
        trainable: False builds a frozen model for log-probs only (the KL reference).
        tp, pp: the layout (``forward_logits`` needs tp = pp = 1).
        features: the optimization level and feature settings (the recipe's ``features:``
            section; default: ``FeaturesConfig()``, level 2, as an LLM recipe). The first actor
            of a process adapts megatron-core with them (:meth:`close` undoes it); the others
            must name the same. The kernels, config fields and hooks they choose build the
            model and the optimizer; :attr:`features` is their report.

    Raises:
        ConfigError: an unreadable directory or an unsupported model.
    """

    #: The model's name in skip lines and learning-rate keys (``actor.lr``); the critic's is ``critic``.
    role = "actor"
    #: Whether the model runs DualPipeV's schedule when the feature is on (the critic does not:
    #: ``build_engine`` refuses the feature for it, its value head is not placed on the V's end).
    runs_dualpipev = True

    def __init__(
        self,
        hf_dir: str,
        settings: ActorSettings | None = None,
        trainable: bool = True,
        tp: int = 1,
        pp: int = 1,
        features: FeaturesConfig | None = None,
    ) -> None:
        # The one construction of the actor, the reference and the critic (Critic(Actor) changes
        # only what its hooks return: _prepare_chunks, _engine_options, role, runs_dualpipev), so
        # every attribute an actor method reads exists on each of them.
        self.settings = s = settings or ActorSettings()
        self.hf_dir, self.trainable = str(hf_dir), trainable
        self.parallel = parallel = ParallelConfig(tp=tp, pp=pp)
        #: What the model's checkpoints record as their recipe (the layout and the source model).
        self.config = PretrainConfig(stage="sft", parallel=parallel, checkpoint=CheckpointConfig(load_hf=self.hf_dir))
        shape = hf_model_shape(self.hf_dir, s.precision)
        # The Hugging Face embedding's rows, padded only as tensor parallelism needs (the logits
        # are then the Hugging Face model's).
        self.hf_vocab = shape.vocab_size
        self.vocab = padded_vocab_size(shape.vocab_size, 1, tp)
        self.adaptation, self._adapted, self.groups = _ensure_megatron(
            shape, parallel, s.seed, features or FeaturesConfig(), dist.get_world_size(), bool(s.compile), bool(s.lora)
        )
        #: DualPipeV (the ``dualpipev`` feature): the V's two chunks per rank, its schedule, the loss on stage 0.
        self.dualpipev = self.runs_dualpipev and uses_dualpipev(self.adaptation)
        load = partial(
            load_hf_weights,
            path=self.hf_dir,
            parallel=parallel,
            vocab_rows=self.vocab,
            groups=self.groups,
            dualpipev=self.dualpipev,
        )
        spec = BuildSpec(
            shape=shape,
            parallel=parallel,
            vocab=self.vocab,
            # Per-token loss: the gradients are divided by the step's total count of trained tokens.
            transformer=partial(build_transformer_config, shape, parallel, per_token_loss=True),
            optimizer=s.optimizer if trainable else None,
            scheduler=s.scheduler,
            # One scheduler position per update; the decay ends at lr_decay_steps (default: warmup + 1).
            scheduler_steps=s.scheduler.lr_warmup_steps + 1,
            prepare=self._prepare_chunks(load),
            bridged=True,
            overrides={} if trainable else {"perform_initialization": False},
            runs_dualpipev=self.runs_dualpipev,  # _schedule runs DualPipeV's schedule on the V's chunks
            **self._engine_options(),
        )
        #: dynamo's counters from the build: the graphs this model's layers compiled (tests, reports).
        self.compile_watch = CompileWatch()
        built = build_engine(spec, self.adaptation, self.groups)
        #: the compiled layers' names (``settings.compile``; empty: eager).
        self.compiled = built.compiled
        self.transformer, self.chunks = built.transformer, built.chunks
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        if not trainable:
            load(self.chunks)
        self.bridge, self.shape, _ = read_hf_shape(self.hf_dir)
        #: Whether microbatches pack each prompt once for the pairs that share it.
        self.share_prompt = resolve_share_prompt(s.share_prompt, pp, shape, self.chunks)
        self.version = 0
        #: Updates refused for a NaN/Inf loss or gradient norm (in all, and in a row).
        self.skips = SkipCounter(s.max_nonfinite_steps, lr_key=f"{self.role}.lr", unit=f"{self.role} update")
        acc = get_accelerator()
        self._offloader = StorageOffloader(acc.device(), pin=acc.supports("pinned_memory"))
        logger.info("%s, tp=%d pp=%d, shared prompts %s", self._summary(), tp, pp, "on" if self.share_prompt else "off")

    def _prepare_chunks(self, load: Any) -> Any:
        """What turns the bare chunks into this model before DDP wraps them (``BuildSpec.prepare``):
        the Hugging Face weights and LoRA for a trainable actor; None for a frozen one (loaded after)."""
        return partial(_load_and_adapt, load=load, lora=self.settings.lora) if self.trainable else None

    def _engine_options(self) -> dict[str, Any]:
        """``BuildSpec`` fields of this model's kind: the actor's compiled layers."""
        return {
            "compile": compile_mode(self.settings.compile),
            "compile_dynamic_tokens": True,  # packed microbatches of every length: one graph
        }

    def _summary(self) -> str:
        """The build's log line (before the layout)."""
        kind = "trainable" if self.trainable else "frozen"
        return f"actor ({kind}) from {self.hf_dir}: {self.bridge.family}"

    @property
    def features(self) -> Any:
        """The ``FeatureReport`` of the adaptation this actor was built with (what is on, and why)."""
        return self.adaptation.features

    def close(self) -> None:
        """Undo the adaptation of megatron-core if this actor made it (call it last, after the other actors)."""
        if self._adapted:
            unadapt()
            self._adapted = False

    # -- batching ------------------------------------------------------------------------------

    def _microbatches(
        self, pairs: Sequence[Pair], width: int, extra: dict[str, torch.Tensor] | None = None
    ) -> list[dict[str, Any]]:
        """THD microbatches of ``pairs`` with ``resp_index`` [n, width] into the packed tokens.

        ``extra`` holds per-pair tensors ``[len(pairs), width]`` (old log-probs, advantages,
        ...) that are cut into the microbatches alongside. With :attr:`share_prompt` the pairs
        of a microbatch that share their prompt ids are packed as one shared-prefix segment.
        """
        mbs, pp = self.settings.micro_batch_size, self.parallel.pp
        return pack_microbatches(pairs, width, mbs, pp, self.share_prompt, get_accelerator().device(), extra)

    def _schedule(
        self, batches: list[dict[str, Any]], loss_fn: Any, forward_only: bool, logits: bool = False
    ) -> list[dict[str, Any]]:
        """Run megatron's schedule (DualPipeV's with :attr:`dualpipev`); the loss stage's output
        (:attr:`loss_stage`) is the per-token CE, or the (vocab-parallel) logits ``[1, T, V_local]``
        with ``logits``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        from mindspeed.megatron.dualpipev import forward_backward_dualpipev

        def forward_step(data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, Any]:
            batch = next(data_iterator)
            output = model(
                batch["tokens"],
                batch["position_ids"],
                None,
                labels=None if logits else batch["labels"],
                packed_seq_params=batch["packed_seq_params"] if self.share_prompt else packed_seq_params(batch),
            )
            return output, partial(loss_fn, batch)

        micro, seq = batches[0]["tokens"].shape
        common = {
            "forward_step_func": forward_step,
            "data_iterator": [iter(batches) for _ in self.chunks],
            "model": self.chunks,
            "num_microbatches": len(batches),
            "seq_length": seq,
            "micro_batch_size": micro,
            "forward_only": forward_only,
            "pg_collection": self.groups,
        }
        if self.dualpipev:
            return forward_backward_dualpipev(**common)
        schedule = get_forward_backward_func(pp_size=self.groups.pp.size())
        return (
            schedule(**common, p2p_communicator=P2PCommunicator(pp_group=self.groups.pp, config=self.transformer)) or []
        )

    # -- log-probs ---------------------------------------------------------------------------

    @staticmethod
    def _gather(batch: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
        logp = -output.float().reshape(-1)
        return logp[batch["resp_index"]] * batch["resp_mask"]

    def _logp_entropy(
        self, batch: dict[str, Any], logits: torch.Tensor, entropy_grad: bool = True, entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, width]`` log-probs and entropies of the response tokens from the model's logits.

        Without ``entropy_grad`` the entropy has no gradient, and on one tensor-parallel rank
        without padding columns the fused head (:mod:`mindspeed_rl.models.logp_head`) computes
        both; it skips the entropy (None) without ``entropy``.
        """

        local = logits.shape[-1]
        targets = batch["resp_targets"]
        tp = self.parallel.tp
        mask = batch["resp_mask"]
        if tp == 1 and local <= self.hf_vocab and not entropy_grad:
            logp, ent = packed_logp_entropy(logits, batch["resp_index"], targets, entropy)
            return logp * mask, None if ent is None else ent * mask
        rows = logits.reshape(-1, local)[batch["resp_index"]]
        group = self.groups.tp if tp > 1 else None
        start = self.groups.tp.rank() * local if tp > 1 else 0
        logp, entropy = vocab_parallel_logp_entropy(rows, targets, start, self.hf_vocab, group)
        return logp * mask, entropy * mask

    @property
    def loss_stage(self) -> int:
        """The pipeline stage that computes the outputs: the last one, or 0 under DualPipeV (the V's end)."""
        return 0 if self.dualpipev else self.parallel.pp - 1

    def _broadcast_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of the loss stage (:attr:`loss_stage`) on every stage (same shape and dtype everywhere)."""

        if self.parallel.pp == 1:
            return tensor
        return broadcast_from_stage(tensor, self.loss_stage, self.groups.pp)

    def compute_logprobs(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """Per-token log-probs of each response given its prompt (forward only, collective).

        Args:
            pairs: ``(prompt ids, response ids)`` per sequence (responses non-empty).

        Returns:
            Per pair, a float32 CPU tensor ``[len(response)]``, on every rank (the last pipeline
            stage broadcasts them). Offloaded weights are onloaded first (the optimizer state
            and gradients stay where they are).
        """
        self._onload_categories(("weights",))
        # As the LLM trainer's step: without the device redirect (the CUDA sites are patched).
        with fast_path():
            return self._compute_logprobs(pairs)

    def _compute_logprobs(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        width = max(len(r) for _, r in pairs)
        batches = self._microbatches(pairs, width)
        # Megatron's fused cross-entropy runs over the whole embedding; with padding rows the
        # log-softmax must leave them out, which needs the logits.
        # Shared prompts: one position predicts the first token of several responses, so the
        # log-probs come from its logits, not from megatron's per-position cross-entropy.
        padded = self.vocab != self.hf_vocab or self.share_prompt

        def collect(batch: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            logp = self._logp_entropy(batch, output, False, False)[0] if padded else self._gather(batch, output)
            return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logp": logp.detach()}

        for chunk in self.chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                outputs = self._schedule(batches, collect, forward_only=True, logits=padded)
        finally:
            for chunk in self.chunks:
                chunk.train()
        if outputs:
            rows = torch.cat([item["logp"] for item in outputs]).float()
        else:  # not the last pipeline stage: receive them
            rows = torch.empty(len(pairs), width, device=get_accelerator().device())
        rows = self._broadcast_last_stage(rows.contiguous()).cpu()
        return [rows[i, : len(r)].clone() for i, (_, r) in enumerate(pairs)]

    # -- update ------------------------------------------------------------------------------

    def update(
        self,
        pairs: Sequence[Pair],
        old_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
        rollout_logp: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the policy loss over all ``pairs`` (collective).

        Args:
            pairs: ``(prompt ids, response ids)`` per sequence.
            old_logp: ``[n, width]`` log-probs of the responses under the policy before this
                update (zero-padded; ``width`` = the longest response); None: the update is the
                first on these samples (one epoch, one mini-batch), so they are the current
                log-probs, taken detached from this forward (as TRL and verl do) and no separate
                log-prob pass is needed.
            advantages: ``[n]`` or ``[n, width]``.
            ref_logp: ``[n, width]`` reference log-probs (with a KL penalty).
            rollout_logp: ``[n, width]`` the rollout engine's log-probs of the samples (with
                truncated importance sampling, ``tis_cap``).
            loss_mask: ``[n, width]`` 1 on the response tokens the policy generated, 0 on those it
                did not (a multi-turn rollout's tool responses): the latter are context only, with
                no loss, no advantage and no part in the metrics. None: every response token counts.

        Returns:
            ``loss`` (the global batch's aggregated loss), the loss's metrics averaged over the
            batch's tokens (``entropy``: the policy's mean token entropy, with
            ``compute_entropy`` or an entropy bonus), ``grad_norm``, ``lr`` (this update's) and
            ``update_tokens``; the
            same on every rank. Whatever was offloaded is onloaded first.

        Raises:
            ValueError: a frozen actor, or tensors that do not match the pairs.
        """
        if self.optimizer is None:
            raise ValueError("this actor is frozen (trainable=False): it cannot be updated")
        self.onload()
        # As the LLM trainer's step: forward, backward and optimizer step without the device
        # redirect (megatron's CUDA call sites are patched by adapt(): mindspeed.megatron.device_sites).
        with fast_path():
            return self._update(pairs, old_logp, advantages, ref_logp, rollout_logp, loss_mask)

    # -- weights -----------------------------------------------------------------------------

    def _check_single(self, what: str) -> None:
        p = self.parallel
        if p.tp != 1 or p.pp != 1:
            raise ValueError(f"{what} needs tp=1 and pp=1 (this actor has tp={p.tp}, pp={p.pp})")

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights under Hugging Face names (for the rollout engine's weight sync).

        Tensor-parallel pieces are gathered over the tensor-parallel group and merged by the
        bridges' rules, pipeline stages broadcast theirs over the pipeline group (collective
        over both): every rank returns the full state. Offloaded weights are onloaded first.

        A LoRA actor returns its merged weights ``W + (alpha / r) B A`` (what the rollout engine
        generates with, and what ``checkpoint.save_hf`` writes).

        Returns:
            Hugging Face name -> tensor on the actor's device. Tensors of a TP1 stage may be
            views of the live parameters: load them into the engine before the next ``update``
            or ``offload(weights=True)`` (which frees those storages).
        """
        self._onload_categories(("weights",))
        p = self.parallel
        # LoRA: the merged weights W + (alpha / r) B A (the tensors taken stay valid after the block).
        with self.merged_weights() if self.lora else contextlib.nullcontext():
            return gather_hf_state(
                self.chunks, self.bridge, self.shape, p.tp, p.pp, self.hf_vocab, self.groups, self.dualpipev
            )

    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits ``[n, vocab]`` of one sequence (tp = pp = 1; for checks against the engine)."""
        self._check_single("forward_logits")
        self._onload_categories(("weights",))
        model = unwrap(self.chunks[0])
        model.eval()
        try:
            with fast_path(), torch.no_grad():
                device = get_accelerator().device()
                tokens = torch.tensor([list(token_ids)], device=device)
                positions = torch.arange(len(token_ids), device=device)[None]
                return model(tokens, positions, None)[0, :, : self.hf_vocab].float().cpu()
        finally:
            model.train()
