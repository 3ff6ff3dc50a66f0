"""The ``logging`` recipe section every suite composes: what a run shows and where it records it.

One :class:`LoggingConfig` for the LLM, MM and RL suites; a suite that draws its own curve extends
it by subclassing (:class:`LossCurveLoggingConfig` adds ``loss_curve``; RL adds ``reward_curve``).
``logging.trackers`` picks the experiment trackers (verl's ``trainer.logger`` names); each tracker's
settings live in its own subsection, and each tracker's library is an optional extra of
``mindspeed-core`` (:data:`EXTRAS`), checked by :meth:`LoggingConfig.check` before the run starts.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from mindspeed.config import ConfigError

#: Tracker names of ``logging.trackers``, as verl's ``trainer.logger``.
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow", "swanlab")
#: The trackers of a recipe that names none: today's ``metrics.jsonl`` and TensorBoard events.
DEFAULT_TRACKERS = ("jsonl", "tensorboard")
#: Tracker -> (module it imports, ``mindspeed-core`` extra that installs it).
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"), "swanlab": ("swanlab", "swanlab")}


@dataclass
class WandbConfig:
    """Weights & Biases (tracker ``wandb``; ``pip install 'mindspeed-core[wandb]'``).

    Attributes:
        project: the W&B project (default ``mindspeed``).
        name: the run's display name (default: W&B's generated one).
        mode: ``online``, ``offline`` (files under ``dir``, upload later with ``wandb sync``) or
            ``disabled`` (default: ``WANDB_MODE``, else W&B's default, online).
        dir: where W&B writes its run files (default: ``logging.dir``).
    """

    project: str = "mindspeed"
    name: str | None = None
    mode: str | None = None
    dir: str | None = None


@dataclass
class MlflowConfig:
    """MLflow (tracker ``mlflow``; ``pip install 'mindspeed-core[mlflow]'``).

    Attributes:
        tracking_uri: the tracking server or store (default: a file store in ``logging.dir/mlruns``,
            else ``MLFLOW_TRACKING_URI``).
        experiment: the experiment's name (created when missing).
        run_name: the run's name (default: MLflow's generated one).
    """

    tracking_uri: str | None = None
    experiment: str = "mindspeed"
    run_name: str | None = None


@dataclass
class SwanlabConfig:
    """SwanLab (tracker ``swanlab``; ``pip install 'mindspeed-core[swanlab]'``).

    Attributes:
        project: the SwanLab project (default ``mindspeed``).
        mode: ``online``, ``offline`` (files under ``logdir``, upload later with ``swanlab sync``),
            ``local`` (needs ``swanlab[dashboard]``) or ``disabled`` (default: SwanLab's, online).
        logdir: where SwanLab writes its run files (default: ``logging.dir/swanlog``).
    """

    project: str = "mindspeed"
    mode: str | None = None
    logdir: str | None = None


_MODES = {"wandb": ("online", "offline", "disabled"), "swanlab": ("online", "offline", "local", "disabled")}


@dataclass
class LoggingConfig:
    """What the run shows and where it records it (rank 0 only).

    Attributes:
        dir: where ``metrics.jsonl``, TensorBoard events and the curves go (default:
            ``checkpoint.save``; none when both are unset).
        interval: log a line every this many steps.
        progress: draw a progress bar (rank 0, on standard error).
        tensorboard: write TensorBoard event files (``false`` takes ``tensorboard`` out of the
            default trackers).
        trackers: the experiment trackers every metric record goes to, of :data:`TRACKERS`
            (default: ``[jsonl, tensorboard]``).
        tensorboard_dir: where TensorBoard events go (default: ``dir/tensorboard``).
        wandb: :class:`WandbConfig`. mlflow: :class:`MlflowConfig`. swanlab: :class:`SwanlabConfig`.
    """

    dir: str | None = None
    interval: int = 1
    progress: bool = True
    tensorboard: bool = True
    trackers: list[str] | None = None
    tensorboard_dir: str | None = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    swanlab: SwanlabConfig = field(default_factory=SwanlabConfig)

    def resolved_trackers(self) -> tuple[str, ...]:
        """The trackers the run opens: ``trackers``, else the defaults less ``tensorboard`` when it is off."""
        if self.trackers is not None:
            return tuple(self.trackers)
        return tuple(t for t in DEFAULT_TRACKERS if t != "tensorboard" or self.tensorboard)

    def check(self) -> None:
        """Check the section's values and that each named tracker's library is installed.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        if self.interval < 1:
            raise ConfigError(f"logging.interval={self.interval} must be at least 1")
        for name in self.trackers or ():
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, TRACKERS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"logging.trackers: unknown tracker {name!r}{hint} (known: {', '.join(TRACKERS)})")
        if self.trackers is not None and len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"logging.trackers={self.trackers} names a tracker twice; list each once")
        if not self.tensorboard and "tensorboard" in (self.trackers or ()):
            raise ConfigError(
                "logging.tensorboard=false but logging.trackers lists tensorboard: drop one of them "
                "(logging.tensorboard is the older switch; logging.trackers wins when given)"
            )
        for name, section in (("wandb", self.wandb), ("swanlab", self.swanlab)):
            if section.mode is not None and section.mode not in _MODES[name]:
                raise ConfigError(
                    f"logging.{name}.mode={section.mode!r} is not one of {', '.join(_MODES[name])}; "
                    "offline keeps the run's files local"
                )
        for name in self.resolved_trackers():
            if name in EXTRAS and importlib.util.find_spec(EXTRAS[name][0]) is None:
                raise ConfigError(
                    f"logging.trackers lists {name} but its library is not installed: "
                    f"pip install 'mindspeed-core[{EXTRAS[name][1]}]' (or remove {name} from logging.trackers)"
                )

    def tensorboard_path(self, log_dir: Path | None) -> Path | None:
        """Where TensorBoard events go: ``tensorboard_dir``, else ``log_dir/tensorboard``."""
        if self.tensorboard_dir:
            return Path(self.tensorboard_dir)
        return log_dir / "tensorboard" if log_dir is not None else None


@dataclass
class LossCurveLoggingConfig(LoggingConfig):
    """:class:`LoggingConfig` of a suite that draws its loss curve (LLM, MM).

    Attributes:
        loss_curve: draw ``dir/loss.png`` at the end.
    """

    loss_curve: bool = True
