"""The training loop over megatron-core: build, (re)load, train, evaluate, checkpoint, report.

One loop serves pretraining, supervised fine-tuning and DPO; the recipe's ``stage`` picks the
data, microbatches and loss (:mod:`mindspeed_llm.training.stages`). :func:`pretrain` runs on every rank of an initialised torch.distributed group (see
:mod:`mindspeed.launch`). It adapts megatron-core to the accelerator with the
recipe's features (``mindspeed.megatron.adapt``), initialises megatron's parallel state, and
undoes both on return, so several runs can follow each other in one process.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mindspeed.checkpointing import (
    NonFiniteState,
    Preemption,
    SkipCounter,
    StopRequest,
    checkpoint_dir,
    export_guard,
    fault_armed,
    fault_point,
    find_resume,
    holds_checkpoints,
    plant_nan,
    resume_hint,
)
from mindspeed.config import ConfigError, to_dict
from mindspeed.device import deterministic_mode, get_accelerator
from mindspeed.features import ModelFacts
from mindspeed.features.context import ParallelSizes
from mindspeed.features.moe import expert_layout
from mindspeed.features.pipeline import noop_layer_layout
from mindspeed.log import RUN_LOG_FILE, get_logger, open_run_log
from mindspeed.megatron import adapt, fast_path, unadapt
from mindspeed.metrics.log import LOSS_CURVE, write_loss_curve
from mindspeed.metrics.trackers import Tracking, open_tracking
from mindspeed_llm.training.checkpoint import TrainState, find_checkpoint, load_checkpoint, save_checkpoint
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.context_parallel import ContextParallelReader, context_parallel_facts, context_parallel_loss
from mindspeed_llm.training.data import read_tokenizer
from mindspeed_llm.training.hf import (
    STAGING_SUFFIXES,
    apply_load_hf,
    checkpoint_args_of,
    export_shape,
    load_hf_weights,
    model_shape,
    save_hf,
)
from mindspeed_llm.training.lora import LoraSettings, apply_lora
from mindspeed_llm.training.lora_io import export_peft, save_lora_adapter
from mindspeed_llm.training.model import (
    build_model,
    count_parameters,
    default_groups,
    padded_vocab_size,
    recipe_transformer_config,
)
from mindspeed_llm.training.optim import build_optimizer, build_scheduler, current_lr, guarded_step
from mindspeed_llm.training.progress import RunReporter
from mindspeed_llm.training.qlora import apply_qlora
from mindspeed_llm.training.stages import get_stage
from mindspeed_llm.training.steps import LM_LOSS, LossTransform, evaluate_metrics, run_schedule

logger = get_logger(__name__)


@dataclass
class TrainerHooks:
    """Python-only seams of the loop (tests and experiments; recipes cannot set them).

    Attributes:
        loss_transform: ``(step, per-token losses) -> per-token losses`` inside the loss.
        after_train: called with this rank's model chunks after the last step (tests read the
            final weights).
    """

    loss_transform: LossTransform | None = None
    after_train: Callable[[list[Any]], None] | None = None


@dataclass
class TrainResult:
    """What a run did, the same on every rank.

    Attributes:
        records: one dict per step (step, loss, lr, grad_norm, skipped, ...).
        evals: one dict per evaluation (step, loss).
        state: the final :class:`TrainState` as a dict.
        stopped: why the run stopped early on an error, one line (``None``: it did not): too many
            non-finite steps in a row, or a checkpoint refused for non-finite state (exit status 1).
        num_parameters: parameters of the whole model.
        features: the run report of the features (``FeatureReport.to_dict()``: what was on and
            why, every change); empty when none were applied.
        preempted: ``"SIGTERM"``, ``"SIGINT"`` or ``"time limit"`` when the run stopped for one
            (after saving a checkpoint); ``None`` otherwise.
        exit_code: the exit status the command should end with (0; 143 / 130 after a signal).
        checkpoint: the newest checkpoint the run wrote or resumed from.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    stopped: str | None = None
    num_parameters: int = 0
    features: dict[str, Any] = field(default_factory=dict)
    preempted: str | None = None
    exit_code: int = 0
    checkpoint: str | None = None


def pretrain(config: PretrainConfig, hooks: TrainerHooks | None = None) -> TrainResult:
    """Train a GPT as ``config`` says (its ``stage``: pretrain, sft, dpo or rm) on the current torch.distributed group.

    Raises:
        ConfigError: the recipe does not fit the world size, the data or the checkpoint.
    """
    world = dist.get_world_size()
    config = apply_load_hf(config)
    config.check(world)
    ids = read_tokenizer(config)
    vocab = padded_vocab_size(ids.vocab_size, config.model.make_vocab_size_divisible_by, config.parallel.tp)
    shape = model_shape(config, ids.vocab_size)
    p = config.parallel
    noop = config.model.noop_indices()
    # The noop layers' pipeline layout (the noop_layers feature sets it for the build) lets
    # megatron accept real layers that the stages do not divide.
    layout = (
        {"pipeline_model_parallel_layout": noop_layer_layout(noop, config.model.num_layers, p.pp, p.vpp or 1)}
        if noop
        else None
    )
    # The memory features check the precision, the optimizer and the layer count against these.
    facts = ModelFacts.from_transformer_config(
        recipe_transformer_config(config, shape, layout),
        position_embedding_type=shape.position_embedding_type,
        precision=config.train.precision,
        num_layers=shape.num_layers,
        distributed_optimizer=config.parallel.distributed_optimizer,
        noop_layers=list(noop),
    )
    if config.parallel.cp > 1:
        facts = context_parallel_facts(facts, config, shape)
    sizes = ParallelSizes(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=config.data_parallel_size(world), vpp=p.vpp or 1)
    log_dir = config.log_dir()
    # The run log (log_dir/report.txt) gets the patch list, the features and third-party warnings.
    with contextlib.ExitStack() as stack:
        if log_dir is not None:
            stack.enter_context(open_run_log(log_dir / RUN_LOG_FILE))
        report = adapt(features=config.features, model=facts, parallel=sizes)
        try:
            stack.enter_context(deterministic_mode(config.train.deterministic, config.train.seed))
            # SIGTERM / Ctrl-C from here on end the run after a step and a checkpoint, not with a traceback.
            with Preemption(config.train.exit_duration_mins, config.checkpoint.save) as preemption:
                return Trainer(config, ids, vocab, report, hooks or TrainerHooks(), preemption).run()
        finally:
            unadapt()


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


class Trainer:
    """One training run of a recipe on the current torch.distributed group (what :func:`pretrain` runs).

    Args:
        config: the recipe (after ``apply_load_hf`` and ``check``).
        ids: the tokenizer's vocabulary size and end-of-document id.
        vocab: the padded vocabulary (embedding rows).
        report: what ``mindspeed.megatron.adapt(features=...)`` returned (the features' config
            overrides and hooks).
        hooks: the caller's hooks (a loss transform).
        preemption: the run's preemption watch (SIGTERM / Ctrl-C / ``train.exit_duration_mins``).

    Components, built by :meth:`build` from the recipe's sections with the section-scoped
    builders, in this order:

    - ``groups``: megatron's process groups as one value (``training.model.default_groups``),
      read once and given to every builder, the schedule and the metric reductions;
    - ``shape``: the :class:`~mindspeed.model.ModelShape` (``training.hf.model_shape``);
    - ``transformer``: megatron's ``TransformerConfig`` (``training.model.recipe_transformer_config``);
    - ``chunks``: this rank's model chunks (``training.model.build_model``); ``reference``: DPO's
      frozen reference model, else ``None``;
    - ``optimizer``: from ``train.optimizer_config()`` (``training.optim.build_optimizer``);
    - ``scheduler``: from ``train.scheduler_config()`` and ``train.steps`` (``training.optim.build_scheduler``);
    - ``state``: the :class:`~mindspeed_llm.training.checkpoint.TrainState` (restored from a
      checkpoint or fresh);
    - ``train_reader`` / ``valid_reader``: the stage's microbatch readers.

    :meth:`run` initialises megatron's parallel state, builds and trains; :meth:`train` runs the
    loop on built components.
    """

    def __init__(
        self, config: PretrainConfig, ids: Any, vocab: int, report: Any, hooks: TrainerHooks, preemption: Preemption
    ) -> None:
        self.config, self.ids, self.vocab, self.report, self.hooks = config, ids, vocab, report, hooks
        self.preemption = preemption
        self.saved_step: int | None = None  # the step of the newest checkpoint in checkpoint.save
        self.world = dist.get_world_size()
        self.stage = get_stage(config.stage)
        self.reference: list[Any] | None = None
        self.groups: Any = None  # megatron's process groups (a ProcessGroupCollection), read once
        # The adaptation is a value: its kernels, config fields and hooks go to the builders.
        self.kernels = report.kernels
        self.feature_hooks = report.hooks
        self.overrides = report.config_overrides

    def run(self) -> TrainResult:
        """Initialise megatron's parallel state for ``parallel``, :meth:`build`, :meth:`train`, tear down."""
        from megatron.core import parallel_state as ps

        p = self.config.parallel
        # Features may change the expert layout (moe_tp_extend_ep): the groups must be the config's.
        ep, etp = expert_layout(self.overrides, p.ep, p.etp)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp,
            context_parallel_size=p.cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        try:
            # Read once: everything below takes the groups as a value.
            self.groups = default_groups()
            seed_everything(self.config.train.seed, self.groups)
            self.build()
            return self.train()
        finally:
            ps.destroy_model_parallel()

    def build(self) -> None:
        """Build every component (collective; megatron's parallel state must be initialised)."""
        if self.groups is None:
            self.groups = default_groups()
        config = self.config
        self.shape = shape = model_shape(config, self.ids.vocab_size)
        bridged = bool(config.checkpoint.load_hf or config.checkpoint.save_hf)
        self.transformer = recipe_transformer_config(config, shape, self.overrides)
        self.chunks = build_model(
            shape,
            config.parallel,
            self.transformer,
            self.vocab,
            prepare=self._prepare,
            bridged=bridged,
            kernels=self.kernels,
            groups=self.groups,
        )
        if self.stage.needs_reference:
            # Its own TransformerConfig: the policy's carries the DDP hooks the schedule calls.
            frozen = recipe_transformer_config(config, shape, {**self.overrides, "perform_initialization": False})
            self.reference = build_model(
                shape,
                config.parallel,
                frozen,
                self.vocab,
                trainable=False,
                bridged=bridged,
                kernels=self.kernels,
                groups=self.groups,
            )
        for hook in self.feature_hooks.get("post_model_build", ()):
            hook(self.chunks)
        self.optimizer = build_optimizer(
            config.train.optimizer_config(), self.chunks, config.parallel, self.kernels, self.groups
        )
        for hook in self.feature_hooks.get("post_optimizer_build", ()):
            self.optimizer = hook(self.optimizer) or self.optimizer
        self.scheduler = build_scheduler(config.train.scheduler_config(), self.optimizer, config.train.steps)
        self.transformer.grad_scale_func = self.optimizer.scale_loss
        self.num_parameters = count_parameters(self.chunks, self.groups)
        self.checkpoint_args = checkpoint_args_of(config, self.ids.vocab_size, self.vocab)
        self.state = self._load()
        t = config.train
        self.skips = SkipCounter(
            t.max_nonfinite_steps, skipped=self.state.skipped_steps, streak=self.state.nonfinite_streak
        )
        if self.reference is not None:
            self._load_reference()
        train, valid = self.stage.datasets(config, self.world, self.ids)
        dp_rank, dp_size = self.groups.dp.rank(), self.groups.dp.size()
        device = get_accelerator().device()

        cp = self.groups.cp

        def read(dataset: Any) -> Any:
            reader = self.stage.reader(dataset, config, dp_rank, dp_size, device, self.ids.eod)
            # Context parallelism: every rank of a CP group reads the same microbatches and keeps its shard.
            return ContextParallelReader(reader, cp.rank(), cp.size()) if cp.size() > 1 else reader

        self.train_reader = read(train)
        self.valid_reader = read(valid) if valid is not None else None

    def _load(self) -> TrainState:
        ck = self.config.checkpoint
        rank0 = dist.get_rank() == 0
        family = getattr(self.checkpoint_args, "model_type_hf", None)
        if ck.save and ck.resume:
            # The newest complete checkpoint of this run wins over checkpoint.load (where it started).
            found = find_resume(ck.save, warn=rank0)
            if found.path is not None:
                self.saved_step = found.step
                return load_checkpoint(
                    found.path, self.chunks, self.optimizer, self.scheduler, self.config, family=family
                )
            if holds_checkpoints(ck.save):
                damaged = "; ".join(f"{path.name}: {why}" for path, why in found.skipped) or "no iter_* directory"
                raise ConfigError(
                    f"checkpoint.save={ck.save!r} holds checkpoints but none is complete ({damaged}); "
                    "set checkpoint.resume=false to train from step 1 there (its checkpoints are "
                    "replaced as the run saves) or set checkpoint.save to a new directory"
                )
        elif ck.save and holds_checkpoints(ck.save) and rank0:
            logger.warning(
                "checkpoint.resume=false: training from step 1; the checkpoints in %s are replaced as this run saves",
                ck.save,
            )
        if ck.load:
            source = find_checkpoint(ck.load)
            state = load_checkpoint(
                source,
                self.chunks,
                self.optimizer,
                self.scheduler,
                self.config,
                weights_only=ck.finetune,
                family=family,
            )
            if ck.finetune or not ck.load_optimizer:
                self._refresh_master_weights()
            return state
        return TrainState()

    def _prepare(self, models: list[Any]) -> None:
        """Base weights and LoRA on the bare chunks, before DDP wraps them and the optimizer sees them."""
        ck, lora = self.config.checkpoint, self.config.lora
        # From Hugging Face weights unless a Megatron checkpoint is named; a resumed run reads
        # them too (QLoRA's quantised base is not in its checkpoints) and then the checkpoint.
        self.stage.adapt_model(models, self.config)
        if ck.load_hf and not ck.load:
            load_hf_weights(
                models,
                ck.load_hf,
                self.config.parallel,
                self.vocab,
                self.groups,
                self.config.model.noop_indices(),
                keep=self.stage.fresh_params,
            )
        if lora.enabled:
            settings = self.lora_settings()
            for model in models:
                (apply_qlora if settings.qlora else apply_lora)(model, settings)

    def lora_settings(self) -> Any:
        """The :class:`~mindspeed_llm.training.lora.LoraSettings` of the recipe."""
        lora = self.config.lora
        return LoraSettings(
            r=lora.r,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=tuple(lora.target_modules),
            qlora=lora.qlora,
            qlora_all_linears=lora.qlora_all_linears,
            seed=self.config.train.seed,
        )

    def _refresh_master_weights(self) -> None:
        # Megatron's mixed-precision optimizers keep fp32 master copies of the weights they were
        # built with: weights loaded afterwards (without optimizer state) must reach them too.
        self.optimizer.reload_model_params()

    def _load_reference(self) -> None:
        """The DPO reference: ``dpo.ref_model``, else the weights the policy started from."""
        ck, source = self.config.checkpoint, self.config.dpo.ref_model
        if source is None and not (ck.load_hf or ck.load):
            raise ConfigError(
                "dpo needs the model to start from: set checkpoint.load_hf or checkpoint.load "
                "(or dpo.ref_model for the reference)"
            )
        if source is None:
            source = ck.load_hf or ck.load
            hf = bool(ck.load_hf) and not ck.load
        else:
            from pathlib import Path

            hf = (Path(source) / "config.json").is_file()
        if hf:
            load_hf_weights(
                self.reference, source, self.config.parallel, self.vocab, self.groups, self.config.model.noop_indices()
            )
            return
        found = find_checkpoint(source, what="dpo.ref_model")
        load_checkpoint(found, self.reference, None, None, self.config, weights_only=True)

    def train(self) -> TrainResult:
        """Train to ``train.steps`` (evaluating and saving as the recipe says) on built components."""
        config, state = self.config, self.state
        t = config.train
        gbs, num_micro = config.global_batch_size(self.world), config.num_microbatches(self.world)
        features = self.report.features
        result = TrainResult(num_parameters=self.num_parameters, features=features.to_dict() if features else {})
        rank0 = dist.get_rank() == 0
        log_dir = config.log_dir()
        reporter = RunReporter(config, self.shape, self.vocab, self.world, self.num_parameters, start=state.step)
        # The trackers of logging.trackers on rank 0 (metrics.jsonl, TensorBoard, ...), the recipe as the run's config.
        metrics = open_tracking(config.logging, log_dir, state.step, rank0, to_dict(config) if rank0 else None)
        try:
            with reporter, self._stop_on_nonfinite_state(result):
                while state.step < t.steps:
                    # The loop runs without the device redirect (the step's CUDA sites are patched);
                    # checkpoints, saved below, are setup-like and keep it.
                    with fast_path():
                        stop = self._stop_request()
                        if stop is None:
                            fault_point("train.step_start", state.step + 1)
                            record = self._step(state, gbs, num_micro)
                            reporter.step(record)
                            metrics.write(record)
                    if stop is not None:
                        self._preempt(stop, result)
                        break
                    result.records.append(record)
                    step = state.step
                    if config.eval.interval and step % config.eval.interval == 0:
                        result.evals.append(self._evaluate(step, metrics, reporter))
                    if self.skips.exhausted():
                        # No save: the run stops where its last complete checkpoint is (the CLI logs the line).
                        result.stopped = self.skips.stop_line(step, t.lr, self._resume_text())
                        break
                    fault_point("train.step_end", step)
                    if self._save_due(step):
                        self._save()
                if result.stopped is None and result.preempted is None:
                    self._finish(result, metrics, reporter)
        finally:
            metrics.close()
        if rank0 and log_dir is not None and config.logging.loss_curve and metrics.path is not None:
            curve = write_loss_curve(metrics.path, log_dir / LOSS_CURVE)
            if curve is not None:
                logger.info("loss curve: %s", curve)
        result.state = asdict(state)
        if self.hooks.after_train is not None:
            self.hooks.after_train(self.chunks)
        if result.checkpoint is None and config.checkpoint.save and self.saved_step is not None:
            result.checkpoint = str(checkpoint_dir(config.checkpoint.save, self.saved_step))
        return result

    @contextlib.contextmanager
    def _stop_on_nonfinite_state(self, result: TrainResult) -> Any:
        # A save refused for NaN/Inf state (interval, preemption or last step) ends the run: exit 1.
        try:
            yield
        except NonFiniteState as err:
            result.stopped = str(err)

    def _resume_text(self) -> str:
        ck = self.config.checkpoint
        if not ck.save or self.saved_step is None:
            return "no checkpoint was saved, it starts from step 1"
        return f"it resumes from {checkpoint_dir(ck.save, self.saved_step)}"

    def _save(self) -> None:
        ck = self.config.checkpoint
        save_checkpoint(
            ck.save, self.state, self.chunks, self.optimizer, self.scheduler, self.config, self.checkpoint_args
        )
        self.saved_step = self.state.step

    def _stop_request(self) -> StopRequest | None:
        return self.preemption.agree(device=get_accelerator().device())

    def _preempt(self, stop: StopRequest, result: TrainResult) -> None:
        """Stop for a signal or the time limit: save this step unless it is saved, and say where."""
        config, step = self.config, self.state.step
        save = config.checkpoint.save
        if save and step > 0 and self.saved_step != step:
            self._save()
        where = str(checkpoint_dir(save, self.saved_step)) if save and self.saved_step is not None else None
        result.preempted, result.exit_code, result.checkpoint = stop.reason, stop.exit_code, where
        cause = (
            f"the time limit (train.exit_duration_mins={config.train.exit_duration_mins})"
            if stop.reason == "time limit"
            else stop.reason
        )
        if dist.get_rank() == 0:
            logger.warning("stopped by %s after step %d of %d: %s", cause, step, config.train.steps, resume_hint(where))

    def _save_due(self, step: int) -> bool:
        ck = self.config.checkpoint
        return bool(ck.save and ck.interval and step % ck.interval == 0)

    def _finish(self, result: TrainResult, metrics: Tracking, reporter: RunReporter) -> None:
        config, step = self.config, self.state.step
        if not result.records and step > 0:  # resumed from a checkpoint of the last step
            logger.info("nothing to train: the checkpoint is already at step %d of %d", step, config.train.steps)
            return
        if config.eval.at_end and not (config.eval.interval and step % config.eval.interval == 0):
            result.evals.append(self._evaluate(step, metrics, reporter))
        ck = config.checkpoint
        if ck.save and ck.save_at_end and not self._save_due(step):
            self._save()
        if ck.save_hf:
            target = Path(ck.save_hf)  # a full disk: one line, the staging directories removed
            with export_guard(target, *(target.with_name(target.name + x) for x in STAGING_SUFFIXES)):
                save_hf(
                    self.chunks,
                    config,
                    step,
                    self.ids.vocab_size,
                    self.vocab,
                    lora=self.lora_settings() if config.lora.enabled else None,
                    groups=self.groups,
                )
        if config.lora.save_adapter or config.lora.save_peft:
            self._save_lora()
        reporter.finish(result.records)

    def _save_lora(self) -> None:
        lora, settings = self.config.lora, self.lora_settings()
        _, shape, _, _ = export_shape(self.config, self.ids.vocab_size)
        if lora.save_adapter:
            save_lora_adapter(self.chunks, lora.save_adapter, shape, None, settings, self.groups)
        if lora.save_peft:
            export_peft(self.chunks, lora.save_peft, shape, self.config.checkpoint.load_hf, settings, self.groups)

    def _step(self, state: TrainState, gbs: int, num_micro: int) -> dict[str, Any]:
        step = state.step + 1
        start = time.perf_counter()
        batches = self.train_reader.step(state.consumed_train_samples, num_micro)
        for hook in self.feature_hooks.get("pre_step", ()):
            hook(step)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        hook = self.hooks.loss_transform
        transform = (lambda losses: hook(step, losses)) if hook is not None else None
        lr = current_lr(self.optimizer)
        self.stage.prepare(self.reference, batches)
        metrics = run_schedule(self.chunks, batches, self._loss_fn(transform), groups=self.groups)
        loss, tokens = metrics[self.stage.metric]
        if fault_armed("train.grad_nan", step) and dist.get_rank() == 0:
            plant_nan(self._first_main_grad())
        # A NaN/Inf loss or gradient norm on any rank: no update, no schedule step (as megatron
        # does for an overflow); the batch is consumed, so the next step sees new data.
        outcome = guarded_step(self.optimizer, loss, get_accelerator().device())
        if outcome.applied:
            self.scheduler.step(1)
        diverged = outcome.reason in ("loss", "grad_norm")
        self.skips.record(outcome.applied, diverged)
        state.skipped_steps, state.nonfinite_streak = self.skips.skipped, self.skips.streak
        if diverged and dist.get_rank() == 0:
            logger.warning(self.skips.skip_line(step, loss, outcome.grad_norm))
        skipped = not outcome.applied
        for hook in self.feature_hooks.get("post_step", ()):
            hook(step)
        state.step = step
        state.consumed_train_samples += gbs
        record = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "skipped": skipped,
            "skipped_steps": state.skipped_steps,
            "tokens": tokens,
            "consumed_samples": state.consumed_train_samples,
            "step_time_s": time.perf_counter() - start,
        }
        record.update({name: value for name, (value, _) in metrics.items() if name not in (LM_LOSS, self.stage.metric)})
        if "sequence_index" in batches[0]:
            record["step_tokens"] = self._step_tokens(batches)
        return record

    def _first_main_grad(self) -> torch.Tensor:
        # Where the train.grad_nan fault point plants its NaN (rank 0, after the data-parallel
        # reduction): the first element of the first gradient buffer, which rank 0's optimizer
        # reads with and without the distributed optimizer (its shard of every bucket comes first).
        buffers = getattr(self.chunks[0], "buffers", None)
        if buffers:
            return buffers[0].grad_data
        param = next(p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad)
        return param.main_grad if getattr(param, "main_grad", None) is not None else param.grad

    def _loss_fn(self, transform: Any = None) -> Any:
        """The stage's loss; under CP, rescaled where megatron averages per microbatch (pretraining)."""
        loss_fn = self.stage.loss_fn(self.config, transform)
        if self.groups.cp.size() > 1 and not self.transformer.calculate_per_token_loss:
            loss_fn = context_parallel_loss(loss_fn, self.groups.cp)
        return loss_fn

    def _step_tokens(self, batches: list[dict[str, Any]]) -> int:
        # Tokens the step processed (padding excluded), over the data- and context-parallel ranks
        # (each CP rank holds its shard of the same sequences: the sum counts every token once).
        local = torch.tensor([sum(int((b["sequence_index"] >= 0).sum()) for b in batches)], dtype=torch.float64)
        dist.all_reduce(local, group=self.groups.dp_cp)
        return int(local.item())

    def _evaluate(self, step: int, metrics: Tracking, reporter: RunReporter) -> dict[str, Any]:
        gbs, num_micro = self.config.global_batch_size(self.world), self.config.num_microbatches(self.world)
        steps = [self.valid_reader.step(i * gbs, num_micro) for i in range(self.config.eval.iters)]
        for batches in steps:
            self.stage.prepare(self.reference, batches)
        with fast_path():
            values = evaluate_metrics(self.chunks, steps, self._loss_fn(), self.groups)
        loss, tokens = values[self.stage.metric]
        record = {"kind": "eval", "step": step, "loss": loss, "tokens": tokens}
        record.update({name: value for name, (value, _) in values.items() if name not in (LM_LOSS, self.stage.metric)})
        if self.stage.metric == LM_LOSS:
            record["perplexity"] = math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss
        metrics.write(record)
        reporter.evaluation(record)
        return record
