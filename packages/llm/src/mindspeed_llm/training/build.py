"""The one build sequence of a megatron-core model, its optimizer and its schedule.

The LLM :class:`~mindspeed_llm.training.trainer.Trainer` and the RL actor
(``mindspeed_rl.models.actor.Actor``) both build through :func:`build_engine`, so the order below is
written once:

1. facts: :func:`model_facts` of a ``TransformerConfig`` before any feature ran (what the
   features check the precision, the optimizer and the layer count against);
2. adapt: ``mindspeed.megatron.adapt(features=..., model=facts, ...)`` by the caller (a recipe
   run adapts per run, the RL actors once per process); its ``AdaptReport`` is a value here;
3. seed: :func:`seed_everything` once megatron's parallel state exists;
4. :func:`build_engine`: the ``TransformerConfig`` with the adaptation's fields, the model chunks
   (base weights loaded by ``prepare`` before DDP wraps them), a frozen reference when asked
   (its own ``TransformerConfig``), the ``post_model_build`` hooks, the optimizer, the
   ``post_optimizer_build`` hooks, the scheduler, and the loss scale handed to the schedule.

Builders take their own sections and the process groups as values, never a recipe.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mindspeed.device import get_accelerator
from mindspeed.features import ModelFacts
from mindspeed.model.shape import ModelShape
from mindspeed.ops.attention import FEATURE_ALIBI
from mindspeed_llm.training.compile import compile_layers
from mindspeed_llm.training.model import build_model, default_groups
from mindspeed_llm.training.optim import build_optimizer, build_scheduler
from mindspeed_llm.training.sections import OptimizerConfig, ParallelConfig, SchedulerConfig

#: ``factory(overrides=fields)``: the ``TransformerConfig`` with those fields (the adaptation's and the caller's).
TransformerFactory = Callable[..., Any]


@dataclass
class BuildSpec:
    """What :func:`build_engine` builds.

    Attributes:
        shape: the model.
        parallel: the layout and its data-parallel options.
        vocab: the padded vocabulary (embedding rows).
        transformer: called as ``transformer(overrides=fields)`` for the ``TransformerConfig``
            (e.g. ``partial(recipe_transformer_config, recipe, shape)`` or
            ``partial(build_transformer_config, shape, parallel)``), with the adaptation's
            config fields and :attr:`overrides`.
        optimizer: the optimizer section; ``None`` builds a frozen model (no DDP, no optimizer,
            no schedule, no hooks).
        scheduler: the schedule section (with ``optimizer``).
        scheduler_steps: the schedule's length in optimizer steps.
        prepare: called with the bare chunks before they are wrapped (base weights, LoRA).
        bridged: Hugging Face weights come in or go out through the bridges.
        overrides: ``TransformerConfig`` fields of the caller, over the adaptation's.
        reference: also build a frozen copy (DPO's reference) right after the model, with its
            own ``TransformerConfig`` (``perform_initialization=False``; the trained model's
            carries the DDP hooks the schedule calls).
        compile: ``torch.compile`` each ``TransformerLayer``'s forward in this mode (a
            ``mindspeed.compile.MODES`` key; ``None``: eager); the frozen reference stays eager.
        runs_dualpipev: the caller runs DualPipeV's schedule on the chunks when the ``dualpipev``
            feature is on (the LLM trainer, its DPO reference, the RL actor); other callers run megatron's schedules, which
            cannot run the V, and the build refuses the feature.
        compile_dynamic_tokens: the compiled layers take the token count as a dynamic size
            (microbatches of varying length, as the RL actor's: one graph instead of one per length).
    """

    shape: ModelShape
    parallel: ParallelConfig
    vocab: int
    transformer: TransformerFactory
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    scheduler_steps: int = 0
    prepare: Callable[[list[Any]], None] | None = None
    bridged: bool = False
    overrides: Mapping[str, Any] = field(default_factory=dict)
    reference: bool = False
    compile: str | None = None
    runs_dualpipev: bool = False
    compile_dynamic_tokens: bool = False


@dataclass
class Engine:
    """What :func:`build_engine` built.

    Attributes:
        transformer: megatron's ``TransformerConfig`` of the model.
        chunks: this rank's model chunks.
        optimizer: megatron's optimizer (``None`` for a frozen model).
        scheduler: its ``OptimizerParamScheduler`` (``None`` for a frozen model).
        reference: the frozen reference's chunks (``BuildSpec.reference``), else ``None``.
        compiled: the compiled layers' names (``BuildSpec.compile``; empty: eager).
    """

    transformer: Any
    chunks: list[Any]
    optimizer: Any = None
    scheduler: Any = None
    reference: list[Any] | None = None
    compiled: list[str] = field(default_factory=list)


def model_facts(transformer: Any, shape: ModelShape, precision: str, distributed_optimizer: bool, **extra: Any) -> Any:
    """The :class:`~mindspeed.features.ModelFacts` the features are checked against (step 1).

    Args:
        transformer: a ``TransformerConfig`` of ``shape`` without the features' fields.
        shape: the model (its position embedding and layer count).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        distributed_optimizer: whether the optimizer state is sharded over data parallelism.
        extra: more facts (``noop_layers``).
    """
    facts = ModelFacts.from_transformer_config(
        transformer,
        position_embedding_type=shape.position_embedding_type,
        precision=precision,
        num_layers=shape.num_layers,
        distributed_optimizer=distributed_optimizer,
        **extra,
    )
    if shape.position_embedding_type == "alibi":  # the attention kernel must take alibi_slopes
        facts = dataclasses.replace(facts, attention_features=(*facts.attention_features, FEATURE_ALIBI))
    return facts


def uses_dualpipev(adaptation: Any) -> bool:
    """Whether the ``dualpipev`` feature is on in ``adapt``'s report (the V build and schedule)."""
    features = getattr(adaptation, "features", None)
    return features is not None and "dualpipev" in features.enabled


def seed_everything(seed: int, groups: Any = None) -> None:
    """Seed as megatron does: one seed per pipeline stage for the host generators (python, numpy,
    torch, the accelerator), and the tracker's tensor-parallel streams derived from the base seed.

    ``groups``: the process groups (``model.default_groups()``; ``None``: read them here).
    Megatron's RNG tracker itself is a module global of megatron (``model_parallel_cuda_manual_seed``).
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    groups = groups if groups is not None else default_groups()
    stage_seed = seed + 100 * groups.pp.rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    get_accelerator().manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def build_engine(spec: BuildSpec, adaptation: Any, groups: Any) -> Engine:
    """Build the model, a frozen reference, the optimizer and the schedule, in the one order (step 4).

    Args:
        spec: what to build.
        adaptation: ``mindspeed.megatron.adapt``'s ``AdaptReport`` (its ``kernels``,
            ``config_overrides`` and ``hooks``).
        groups: megatron's process groups as one value (``default_groups()``).

    Returns:
        The built :class:`Engine` (collective: every rank of ``groups`` calls it).
    """
    kernels, hooks = adaptation.kernels, adaptation.hooks
    if uses_dualpipev(adaptation) and not spec.runs_dualpipev:
        raise ValueError(
            "features.settings.dualpipev: this runner runs megatron's own schedules, which cannot run the V; "
            "set features.settings.dualpipev.enabled=false"
        )
    overrides = {**adaptation.config_overrides, **spec.overrides}
    trainable = spec.optimizer is not None

    def build(transformer: Any, prepare: Any, train: bool) -> list[Any]:
        return build_model(
            spec.shape,
            spec.parallel,
            transformer,
            spec.vocab,
            prepare=prepare,
            trainable=train,
            bridged=spec.bridged,
            kernels=kernels,
            groups=groups,
            dualpipev=uses_dualpipev(adaptation),
        )

    transformer = spec.transformer(overrides=overrides)
    engine = Engine(transformer, build(transformer, spec.prepare, trainable))
    if spec.compile is not None:  # before the features' hooks: what they wrap around a layer stays eager
        engine.compiled = compile_layers(engine.chunks, spec.compile, spec.compile_dynamic_tokens)
    if spec.reference:
        frozen = spec.transformer(overrides={**overrides, "perform_initialization": False})
        engine.reference = build(frozen, None, False)
    if not trainable:
        return engine
    for hook in hooks.get("post_model_build", ()):
        hook(engine.chunks)
    optimizer = build_optimizer(spec.optimizer, engine.chunks, spec.parallel, kernels, groups)
    for hook in hooks.get("post_optimizer_build", ()):
        optimizer = hook(optimizer) or optimizer
    engine.optimizer = optimizer
    engine.scheduler = build_scheduler(spec.scheduler, optimizer, spec.scheduler_steps)
    transformer.grad_scale_func = optimizer.scale_loss
    return engine
