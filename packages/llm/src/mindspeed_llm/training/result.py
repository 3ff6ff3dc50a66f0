"""What a training run did (:class:`TrainResult`): returned by :func:`~mindspeed_llm.training.trainer.pretrain`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        compile: ``train.compile`` as used (empty for an eager run): ``mode``, ``layers`` compiled,
            ``graphs`` dynamo compiled and ``seconds`` spent compiling in the first step, and
            ``graphs_after_first_step`` (0: no recompilation).
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
    compile: dict[str, Any] = field(default_factory=dict)
