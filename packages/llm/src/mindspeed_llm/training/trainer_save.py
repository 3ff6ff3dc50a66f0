"""How the LLM :class:`~mindspeed_llm.training.trainer.Trainer` saves and stops: interval and final
checkpoints, the Hugging Face and LoRA exports at the end, preemption (a signal or the time
limit) and a save refused for non-finite state.

:class:`TrainerSaving` is a part of the ``Trainer``: it reads the trainer's ``config``,
``state``, ``chunks``, ``optimizer``, ``scheduler``, ``ids``, ``vocab``, ``groups``,
``checkpoint_args`` and ``preemption``, and its ``_evaluate`` and ``lora_settings``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from mindspeed.checkpointing import NonFiniteState, StopRequest, checkpoint_dir, export_guard, resume_hint
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.metrics.trackers import Tracking
from mindspeed_llm.training.async_save import PendingSave, agree_written, start_checkpoint
from mindspeed_llm.training.checkpoint import save_checkpoint
from mindspeed_llm.training.hf import STAGING_SUFFIXES, export_shape, save_hf
from mindspeed_llm.training.lora_io import export_peft, save_lora_adapter
from mindspeed_llm.training.progress import RunReporter

if TYPE_CHECKING:
    from mindspeed_llm.training.result import TrainResult

logger = get_logger("mindspeed_llm.training.trainer")


class TrainerSaving:
    """The trainer's checkpoints, exports and early stops."""

    config: Any
    state: Any
    chunks: list[Any]
    optimizer: Any
    scheduler: Any
    ids: Any
    vocab: int
    groups: Any
    checkpoint_args: Any
    preemption: Any
    saved_step: int | None
    #: The asynchronous save in flight (``checkpoint.async_save``): at most one.
    pending_save: PendingSave | None = None

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
        if ck.async_save:
            self._wait_for_save()  # at most one save in flight
            self.pending_save = start_checkpoint(
                ck.save, self.state, self.chunks, self.optimizer, self.scheduler, self.config, self.checkpoint_args
            )
        else:
            save_checkpoint(
                ck.save, self.state, self.chunks, self.optimizer, self.scheduler, self.config, self.checkpoint_args
            )
        self.saved_step = self.state.step

    def _poll_save(self) -> None:
        """Complete the save in flight if every rank's files are written (collective while one is in flight)."""
        # Nothing in flight (the default: checkpoint.async_save off): no device lookup, which would
        # make a torch-function hop per step outside the fast path (tests/llm/training/test_fast_path.py).
        if self.pending_save is not None and agree_written(self.pending_save, get_accelerator().device()):
            self._wait_for_save()

    def _wait_for_save(self) -> None:
        """Complete the save in flight, waiting for its files (collective while one is in flight)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.finish()

    def _stop_request(self) -> StopRequest | None:
        return self.preemption.agree(device=get_accelerator().device())

    def _preempt(self, stop: StopRequest, result: TrainResult) -> None:
        """Stop for a signal or the time limit: save this step unless it is saved, and say where."""
        config, step = self.config, self.state.step
        save = config.checkpoint.save
        if save and step > 0 and self.saved_step != step:
            self._save()
        self._wait_for_save()  # the line below names a complete checkpoint
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
        self._wait_for_save()
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
