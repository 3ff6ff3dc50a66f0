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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import Preemption, SkipCounter, checkpoint_dir, fault_armed, fault_point, plant_nan
from mindspeed.compile import CompileWatch, compile_mode
from mindspeed.config import to_dict
from mindspeed.device import deterministic_mode, get_accelerator
from mindspeed.features.context import ParallelSizes
from mindspeed.features.moe import expert_layout
from mindspeed.features.pipeline import noop_layer_layout
from mindspeed.log import RUN_LOG_FILE, get_logger, open_run_log
from mindspeed.megatron import adapt, fast_path, unadapt
from mindspeed.megatron.config import expert_tensor_parallel_size
from mindspeed.metrics.log import LOSS_CURVE, write_loss_curve
from mindspeed.metrics.moe import moe_aux_losses
from mindspeed.metrics.trackers import Tracking, open_tracking
from mindspeed.model.shape import ModelShape
from mindspeed_llm.training.build import BuildSpec, build_engine, model_facts, seed_everything, uses_dualpipev
from mindspeed_llm.training.checkpoint import TrainState
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.context_parallel import ContextParallelReader, context_parallel_facts, context_parallel_loss
from mindspeed_llm.training.data import read_tokenizer
from mindspeed_llm.training.hf import apply_load_hf, checkpoint_args_of, model_shape
from mindspeed_llm.training.model import count_parameters, default_groups, padded_vocab_size, recipe_transformer_config
from mindspeed_llm.training.optim import current_lr, guarded_step
from mindspeed_llm.training.progress import RunReporter
from mindspeed_llm.training.result import TrainResult
from mindspeed_llm.training.stages import get_stage
from mindspeed_llm.training.steps import LM_LOSS, LossTransform, evaluate_metrics, run_schedule
from mindspeed_llm.training.trainer_load import TrainerLoading
from mindspeed_llm.training.trainer_save import TrainerSaving

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
    transformer = recipe_transformer_config(config, shape, layout)
    facts = model_facts(
        transformer,
        shape,
        config.train.precision,
        config.parallel.distributed_optimizer,
        noop_layers=list(noop),
        compiled_layers=bool(config.train.compile),
        # What the pipeline schedule (dualpipev) checks the run against.
        tie_embeddings=shape.tie_embeddings,
        mtp_num_layers=shape.mtp_num_layers or 0,
        num_microbatches=config.num_microbatches(world),
        overlap_grad_reduce=p.overlap_grad_reduce,
        variable_seq_lengths=bool(transformer.variable_seq_lengths),
        hf_weights=bool(config.checkpoint.save_hf),  # the export (the import loads the V's layout)
        lora=config.lora.enabled,
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
                return Trainer(config, ids, vocab, shape, report, hooks or TrainerHooks(), preemption).run()
        finally:
            unadapt()


class Trainer(TrainerLoading, TrainerSaving):
    """One training run of a recipe on the current torch.distributed group (what :func:`pretrain` runs).

    Args:
        config: the recipe (after ``apply_load_hf`` and ``check``).
        ids: the tokenizer's vocabulary size and end-of-document id.
        vocab: the padded vocabulary (embedding rows).
        shape: the :class:`~mindspeed.model.ModelShape` (``training.hf.model_shape``; :func:`pretrain`
            reads it once for the features' facts and the build).
        report: what ``mindspeed.megatron.adapt(features=...)`` returned (the features' config
            overrides and hooks).
        hooks: the caller's hooks (a loss transform).
        preemption: the run's preemption watch (SIGTERM / Ctrl-C / ``train.exit_duration_mins``).

    Components, built by :meth:`build` from the recipe's sections with the section-scoped
    builders, in this order:

    - ``groups``: megatron's process groups as one value (``training.model.default_groups``),
      read once and given to every builder, the schedule and the metric reductions;
    - ``transformer``, ``chunks``, ``reference`` (DPO's frozen reference model, else ``None``),
      ``optimizer`` (from ``train.optimizer_config()``) and ``scheduler`` (from
      ``train.scheduler_config()`` and ``train.steps``): the build sequence shared with the RL
      actor (:func:`mindspeed_llm.training.build.build_engine`; the ``TransformerConfig`` of
      ``training.model.recipe_transformer_config``);
    - ``state``: the :class:`~mindspeed_llm.training.checkpoint.TrainState` (restored from a
      checkpoint or fresh);
    - ``train_reader`` / ``valid_reader``: the stage's microbatch readers.

    :meth:`run` initialises megatron's parallel state, builds and trains; :meth:`train` runs the
    loop on built components.
    """

    def __init__(
        self,
        config: PretrainConfig,
        ids: Any,
        vocab: int,
        shape: ModelShape,
        report: Any,
        hooks: TrainerHooks,
        preemption: Preemption,
    ) -> None:
        self.config, self.ids, self.vocab, self.report, self.hooks = config, ids, vocab, report, hooks
        self.shape = shape
        self.preemption = preemption
        self.saved_step: int | None = None  # the step of the newest checkpoint in checkpoint.save
        self.world = dist.get_world_size()
        self.stage = get_stage(config.stage)
        self.reference: list[Any] | None = None
        self.groups: Any = None  # megatron's process groups (a ProcessGroupCollection), read once
        # The adaptation is a value: its kernels, config fields and hooks go to the builders.
        self.feature_hooks = report.hooks
        self.overrides = report.config_overrides

    def run(self) -> TrainResult:
        """Initialise megatron's parallel state for ``parallel``, :meth:`build`, :meth:`train`, tear down."""
        from megatron.core import parallel_state as ps

        p = self.config.parallel
        # Features may change the expert layout (moe_tp_extend_ep): the groups must be the config's.
        ep, etp = expert_layout(self.overrides, p.ep, p.etp)
        etp = expert_tensor_parallel_size(self.shape, etp)  # experts with biases: 1 (megatron's limit)
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
        spec = BuildSpec(
            shape=self.shape,
            parallel=config.parallel,
            vocab=self.vocab,
            transformer=partial(recipe_transformer_config, config, self.shape),
            optimizer=config.train.optimizer_config(),
            scheduler=config.train.scheduler_config(),
            scheduler_steps=config.train.steps,
            prepare=self._prepare,
            bridged=bool(config.checkpoint.load_hf or config.checkpoint.save_hf),
            reference=self.stage.needs_reference,
            compile=compile_mode(config.train.compile),
            runs_dualpipev=True,
            # Microbatches padded only to data.pad_to_multiple_of: one graph for every length.
            compile_dynamic_tokens=config.data.variable_seq_lengths,
        )
        self.compile_watch = CompileWatch()  # dynamo's counters from here: this run's graphs and compile time
        built = build_engine(spec, self.report, self.groups)
        self.compiled = built.compiled
        self.transformer, self.chunks, self.reference = built.transformer, built.chunks, built.reference
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
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
                    if len(result.records) == 1:
                        self._compiled_first_step(result)
                    step = state.step
                    if config.eval.interval and step % config.eval.interval == 0:
                        result.evals.append(self._evaluate(step, metrics, reporter))
                    if self.skips.exhausted():
                        # No save: the run stops where its last complete checkpoint is (the CLI logs the line).
                        result.stopped = self.skips.stop_line(step, t.lr, self._resume_text())
                        break
                    fault_point("train.step_end", step)
                    self._poll_save()
                    if self._save_due(step):
                        self._save()
                if result.stopped is None and result.preempted is None:
                    self._finish(result, metrics, reporter)
                self._wait_for_save()  # a run that stopped early keeps its last save too
        finally:
            metrics.close()
        if rank0 and log_dir is not None and config.logging.loss_curve and metrics.path is not None:
            curve = write_loss_curve(metrics.path, log_dir / LOSS_CURVE)
            if curve is not None:
                logger.info("loss curve: %s", curve)
        result.state = asdict(state)
        if result.compile:
            result.compile["graphs_after_first_step"] = self.compile_watch.graphs() - result.compile["graphs"]
        if self.hooks.after_train is not None:
            self.hooks.after_train(self.chunks)
        if result.checkpoint is None and config.checkpoint.save and self.saved_step is not None:
            result.checkpoint = str(checkpoint_dir(config.checkpoint.save, self.saved_step))
        return result

    def _compiled_first_step(self, result: TrainResult) -> None:
        """Report ``train.compile`` after the run's first step (it compiled there): what, how many graphs, how long."""
        if not self.compiled:
            return
        watch = self.compile_watch
        result.compile = {
            "mode": compile_mode(self.config.train.compile),
            "layers": len(self.compiled),
            "graphs": watch.graphs(),
            "seconds": round(watch.seconds(), 3),
        }
        logger.info(
            "compile: %d TransformerLayer forwards, %d graphs compiled in %.1f s (in the first step)",
            len(self.compiled),
            watch.graphs(),
            watch.seconds(),
        )

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
        self.stage.prepare(self.reference, batches, self.groups, uses_dualpipev(self.report))
        metrics = run_schedule(
            self.chunks,
            batches,
            self._loss_fn(transform),
            groups=self.groups,
            schedule_hooks=self.feature_hooks.get("pipeline_schedule", ()),
            dualpipev=uses_dualpipev(self.report),
        )
        loss, tokens = metrics[self.stage.metric]
        aux_losses = moe_aux_losses(self.transformer, num_micro, get_accelerator().device())
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
        record.update(aux_losses)
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
            self.stage.prepare(self.reference, batches, self.groups, uses_dualpipev(self.report))
        with fast_path():
            values = evaluate_metrics(
                self.chunks, steps, self._loss_fn(), self.groups, dualpipev=uses_dualpipev(self.report)
            )
        loss, tokens = values[self.stage.metric]
        record = {"kind": "eval", "step": step, "loss": loss, "tokens": tokens}
        record.update({name: value for name, (value, _) in values.items() if name not in (LM_LOSS, self.stage.metric)})
        if self.stage.metric == LM_LOSS:
            record["perplexity"] = math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss
        metrics.write(record)
        reporter.evaluation(record)
        return record
