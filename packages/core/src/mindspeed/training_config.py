"""The ``train`` recipe section every suite composes: how long a run trains and how it stops (and the
``eval`` section of the suites that score held-out data).

:class:`TrainConfig` holds what every trainer's loop has (steps, seed, the non-finite-step guard,
the time limit); :class:`OptimizerTrainConfig` adds the batch, precision, optimizer and
learning-rate schedule of a suite whose ``train`` section owns its optimizer (LLM, MM; the RL
suite's optimizer belongs to its ``actor`` section). Each checks its own fields; a suite extends
them by subclassing (suite-only fields and defaults in the subclass), never by copying them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mindspeed.config import ConfigError


@dataclass
class TrainConfig:
    """The training loop's length and stops.

    Attributes:
        steps: optimizer steps to train (the last step number).
        seed: seed of the weights, the random number generators and the data order.
        max_nonfinite_steps: stop after this many consecutive steps with a NaN/Inf loss or gradient
            norm (each is skipped before the optimizer applies it: no update, no schedule step);
            exit status 1.
        exit_duration_mins: stop after this many minutes of training (megatron's
            ``--exit-duration-in-mins``): the current step finishes, a checkpoint is saved and
            the command exits 0; the same command resumes.
    """

    steps: int = 100
    seed: int = 1234
    max_nonfinite_steps: int = 3
    exit_duration_mins: float | None = None

    def check(self) -> None:
        """Check the section's values.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        for key in ("steps", "max_nonfinite_steps"):
            value = getattr(self, key)
            if value < 0:
                raise ConfigError(f"train.{key}={value} must not be negative")
        if self.exit_duration_mins is not None and not self.exit_duration_mins > 0:
            raise ConfigError(f"train.exit_duration_mins={self.exit_duration_mins} must be positive (or unset)")


@dataclass
class OptimizerTrainConfig(TrainConfig):
    """:class:`TrainConfig` of a suite whose ``train`` section owns the batch, precision and optimizer.

    Attributes:
        micro_batch_size: samples per microbatch on one data-parallel rank.
        precision: ``fp32`` or ``bf16`` (bf16 weights with fp32 master weights in the optimizer).
        lr: peak learning rate.
        min_lr: learning rate at the end of the decay.
        lr_warmup_steps: linear warmup steps.
        lr_decay_style: the decay after the warmup (to ``min_lr``).
        weight_decay: AdamW decoupled weight decay.
        adam_beta1: Adam beta1.
        adam_beta2: Adam beta2.
        adam_eps: Adam epsilon.
        clip_grad: clip the global gradient norm to this (0: no clipping).
        deterministic: bit-reproducible runs (MindSpeed's ``--npu-deterministic``): torch's
            deterministic algorithms and the accelerator's deterministic settings
            (:func:`mindspeed.device.deterministic_mode`).
    """

    micro_batch_size: int = 1
    precision: Literal["fp32", "bf16"] = "fp32"
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["cosine", "linear", "constant", "inverse-square-root"] = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    deterministic: bool = False

    #: Keys that must not be negative (a subclass adds its own). ``lr`` 0 is allowed here: an MM run at
    #: learning rate 0 scores the untrained model (the LLM suite asks for a positive one).
    NON_NEGATIVE = ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad")

    def check(self) -> None:
        """Check the loop's values, the batch and the optimizer's numbers, named by their recipe keys
        (torch would say only "Invalid learning rate").

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        if self.micro_batch_size < 1:
            raise ConfigError(f"train.micro_batch_size={self.micro_batch_size} must be at least 1")
        super().check()
        for key in self.NON_NEGATIVE:
            value = getattr(self, key)
            if not value >= 0:
                raise ConfigError(f"train.{key}={value} must not be negative; give 0 or more")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            if not 0 <= value < 1:
                raise ConfigError(f"train.{key}={value} must be in [0, 1), e.g. 0.9")
        self.check_schedule()

    def check_schedule(self) -> None:
        """The learning rates against each other (a suite with more schedule keys extends this)."""
        if self.lr < self.min_lr:
            raise ConfigError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}; lower it")


@dataclass
class EvalConfig:
    """The ``eval`` section: the validation loss during and after training (megatron's ``--eval-interval`` /
    ``--eval-iters``).

    Attributes:
        interval: evaluate every this many steps (default: not during training).
        iters: global batches of held-out samples per evaluation, the same first ones each time so
            evaluations are comparable (default: the suite's).
        at_end: evaluate after the last step too.
    """

    interval: int | None = None
    iters: int | None = None
    at_end: bool = False

    def check(self) -> None:
        """Check the counts.

        Raises:
            ConfigError: naming the key and the fix.
        """
        if self.interval is not None and self.interval < 1:
            raise ConfigError(f"eval.interval={self.interval} must be at least 1 (or unset)")
        if self.iters is not None and self.iters < 1:
            raise ConfigError(f"eval.iters={self.iters} must be at least 1")
