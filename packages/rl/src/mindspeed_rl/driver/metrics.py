"""What a GRPO run writes about itself: the core's trackers, ``reward.png``, a console line.

The driver calls :meth:`RLMetricsLog.log` once per step with the record of
:func:`mindspeed_rl.driver.trainer.grpo_step` (a flat ``name -> number`` dict with ``step``). The
records go to the core's :class:`~mindspeed.metrics.trackers.Tracking` (``logging.trackers``):
``metrics.jsonl`` gets one line per step, flushed when written, and a resumed run drops the
records after its checkpoint's step so the file reads as one continuous run. Every numeric key
also becomes a TensorBoard (wandb, MLflow, SwanLab) scalar under its own name (``reward/<fn>``,
``time/<phase>`` group themselves by the slash), with ``purge_step`` on resume. :meth:`RLMetricsLog.close` draws ``reward.png`` from the JSONL
file, so the curve spans resumes. :func:`format_step` and :class:`ProgressLine` are the console
side; :func:`per_device` turns the token rates into per-device rates. Every metric is defined
in ``docs/rl/metrics.md``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from mindspeed.log import get_logger
from mindspeed.metrics.config import LoggingConfig
from mindspeed.metrics.log import METRICS_FILE, TENSORBOARD_DIR, read_metrics
from mindspeed.metrics.trackers import open_tracking
from mindspeed.progress import StatusProgress

logger = get_logger(__name__)

REWARD_CURVE = "reward.png"
#: Token rates of a record (tokens per second over the whole job); :func:`per_device` divides them.
TPS_KEYS = ("rollout_tps", "update_tps", "e2e_tps")

__all__ = [
    "METRICS_FILE",
    "REWARD_CURVE",
    "TENSORBOARD_DIR",
    "TPS_KEYS",
    "ProgressLine",
    "RLMetricsLog",
    "format_step",
    "step_fields",
    "per_device",
    "read_metrics",
    "write_reward_curve",
]


def _number(value: Any) -> float | None:
    # bool is an int subclass, but True is not a metric value worth a curve.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def per_device(record: Mapping[str, Any], num_devices: int) -> dict[str, Any]:
    """The record with its token rates (:data:`TPS_KEYS`) divided by the number of devices.

    ``grpo_step`` measures job-wide rates (all tokens over wall seconds); MindSpeed-RL reports
    ``e2e_tps``, ``update_tps`` and the rollout rate per device, so runs on different device
    counts compare directly. Other keys are copied unchanged.

    Args:
        record: one step's metrics.
        num_devices: accelerators (or CPU ranks) the job uses, rollout and training together.

    Returns:
        A new dict.

    Raises:
        ValueError: ``num_devices`` below 1.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    out = dict(record)
    for key in TPS_KEYS:
        if _number(out.get(key)) is not None:
            out[key] = out[key] / num_devices
    return out


def _fmt(value: float) -> str:
    # 4 significant digits, but no exponent for everyday magnitudes.
    return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def step_fields(record: Mapping[str, Any], total_steps: int) -> list[str]:
    """The fields of :func:`format_step`'s line, in its order (``step 3/100`` first)."""
    step = record.get("step")
    head = f"step {int(step)}" if _number(step) is not None else "step ?"
    parts = [f"{head}/{total_steps}" if total_steps > 0 else head]
    mean, std = _number(record.get("reward_mean")), _number(record.get("reward_std"))
    if mean is not None:
        parts.append(f"reward {mean:.3f}" + (f"+-{std:.3f}" if std is not None else ""))
    held_out = _number(record.get("eval/reward_mean"))
    if held_out is not None:
        parts.append(f"eval {held_out:.3f}")
    for key, label, form in (
        ("response_length", "len", "{:.1f}"),
        ("loss", "loss", None),
        ("kl_loss", "kl", None),
        ("entropy", "ent", None),
        ("pg_clipfrac", "clip", "{:.3f}"),
        ("load_balancing_loss", "lb", "{:.3f}"),
        ("staleness_mean", "stale", "{:.2f}"),
        ("tools/calls", "calls", "{:.2f}"),
    ):
        value = _number(record.get(key))
        if value is not None:
            parts.append(f"{label} {form.format(value) if form else _fmt(value)}")
    tps = _number(record.get("e2e_tps"))
    if tps is not None:
        parts.append(f"{tps:.0f} tok/s")
    seconds = _number(record.get("time/step"))
    if seconds is not None:
        parts.append(f"{seconds:.2f} s")
    return parts


def format_step(record: Mapping[str, Any], total_steps: int) -> str:
    """A one-line summary of a step for the console.

    ``step 3/100 | reward 0.512+-0.301 | len 87.3 | loss 0.0123 | kl 0.0012 | ent 1.23 | clip 0.031 |
    lb 1.012 | stale 0.5 | calls 1.25 | 1234 tok/s | 12.3 s``; fields the record lacks (or holds as NaN) are
    left out: ``eval`` (after the reward) is the held-out ``eval/reward_mean`` where the step evaluated, ``kl`` is
    ``kl_loss`` (to the reference), ``ent`` ``entropy``, ``clip`` ``pg_clipfrac``, ``lb`` a MoE
    policy's ``load_balancing_loss`` (1 is an even load under the Switch loss), ``stale``
    ``staleness_mean``, ``calls`` ``tools/calls`` (multi-turn rollouts), ``tok/s`` ``e2e_tps`` and the last field ``time/step``.

    Args:
        record: one step's metrics (with ``step``).
        total_steps: steps the run will make (0: unknown, the total is left out).

    Returns:
        The line, without a newline.
    """
    return " | ".join(step_fields(record, total_steps))


class ProgressLine:
    """The console side of a run: a rich progress bar on a terminal, plain log lines otherwise.

    On a terminal the bar (:class:`mindspeed.progress.StatusProgress`) shows the stage, ``steps
    done / total``, the time taken and left, then the fields of :func:`format_step` after the
    step, as many as the terminal's width holds (the reward first). When the stream is not a
    terminal (CI logs, files, ``nohup``) or ``bar`` is off, each step is one ``INFO`` log line
    instead: a bar's carriage returns would only garble a log file.

    Args:
        total_steps: steps the run will make.
        bar: ``True`` for a bar when ``stream`` is a terminal, ``False`` for plain lines.
        stream: where the bar draws (default ``sys.stderr``).
        interval: log every ``interval``-th step in plain-line mode (the bar updates every step).
        stage: the name the bar starts with (``grpo``, ``dapo``, ...).
        start: the step the run resumes after (the time left is estimated from the steps after it).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        bar: bool = True,
        stream: TextIO | None = None,
        interval: int = 1,
        stage: str = "grpo",
        start: int = 0,
    ) -> None:
        self.total_steps = total_steps
        self.interval = max(int(interval), 1)
        self._bar: StatusProgress | None = None
        stream = stream if stream is not None else sys.stderr
        if bar and _is_terminal(stream):
            console = Console(file=stream, force_terminal=True)
            self._bar = StatusProgress(
                stage, total=total_steps or None, disable=False, completed=start, console=console, separator=" | "
            )
            self._bar.__enter__()

    @property
    def uses_bar(self) -> bool:
        """Whether a progress bar is drawn (else plain log lines)."""
        return self._bar is not None

    def update(self, record: Mapping[str, Any]) -> str:
        """Show one step's record.

        Returns:
            The :func:`format_step` line.
        """
        fields = step_fields(record, self.total_steps)
        line = " | ".join(fields)
        step = _number(record.get("step"))
        if self._bar is not None:
            self._bar.update(status=fields[1:], completed=int(step) if step is not None else None, advance=0)
        elif step is None or int(step) % self.interval == 0 or int(step) == self.total_steps:
            logger.info("%s", line)
        return line

    def close(self) -> None:
        """Stop the bar (leaving its last state on screen)."""
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class RLMetricsLog:
    """Per-step records of a GRPO run: the core's trackers (:func:`~mindspeed.metrics.trackers.open_tracking`:
    ``metrics.jsonl``, TensorBoard, wandb, MLflow, SwanLab as ``logging.trackers`` says) and ``reward.png``.

    Args:
        log_dir: the run's log directory (created; ``None``: no JSONL, TensorBoard or curve).
        tensorboard: write TensorBoard events to ``log_dir/tensorboard``, one scalar per numeric key
            (used when ``settings`` is not given).
        reward_curve: draw ``log_dir/reward.png`` at :meth:`close`.
        resume_step: the step the run resumes after: JSONL records after it are dropped and
            TensorBoard hides later events (0: a new run, the file starts empty).
        settings: the recipe's ``logging`` section (trackers and their settings).
        config: the resolved recipe, logged as the run's config.
        enabled: whether this process records (the in-process trainer's rank 0; the Ray driver
            always): other ranks get trackers whose calls do nothing.

    Example::

        with RLMetricsLog(Path("runs/x"), tensorboard=True, reward_curve=True) as sink:
            for _ in range(steps):
                sink.log(grpo_step(ctx))
    """

    def __init__(
        self,
        log_dir: Path | None,
        *,
        tensorboard: bool = True,
        reward_curve: bool,
        resume_step: int = 0,
        settings: LoggingConfig | None = None,
        config: Mapping[str, Any] | None = None,
        enabled: bool = True,
    ) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.reward_curve = reward_curve
        settings = settings if settings is not None else LoggingConfig(tensorboard=tensorboard)
        self.tracking = open_tracking(settings, self.log_dir, resume_step, enabled, config)

    @property
    def path(self) -> Path | None:
        """The ``metrics.jsonl`` file (``None`` without a log directory)."""
        return self.log_dir / METRICS_FILE if self.log_dir is not None else None

    def log(self, record: Mapping[str, Any]) -> None:
        """Send one step's record to every tracker (the JSONL line is flushed).

        Args:
            record: ``name -> value`` with ``step``; non-finite floats are written as the strings
                ``"nan"`` / ``"inf"`` in the JSONL and left out of the other trackers.

        Raises:
            ValueError: the record has no numeric ``step``.
        """
        if _number(record.get("step")) is None:
            raise ValueError(f"a metrics record needs a numeric 'step'; got keys {sorted(record)[:8]}")
        self.tracking.write(dict(record))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log validation samples (prompt, response, reward) as a table where a tracker has one."""
        self.tracking.log_samples(step, rows, name="eval/samples")

    def close(self) -> Path | None:
        """Close the trackers and draw ``reward.png`` (when asked for).

        Returns:
            The PNG's path, or ``None`` when none was drawn.
        """
        self.tracking.close()
        if self.reward_curve and self.path is not None and self.tracking.path is not None:
            return write_reward_curve(self.path, self.log_dir / REWARD_CURVE)
        return None

    def __enter__(self) -> RLMetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_reward_curve(metrics: Path, target: Path) -> Path | None:
    """Draw reward (mean with a +-std band, the held-out ``eval/reward_mean`` where evaluated) and
    response length against the step into a PNG.

    Args:
        metrics: a ``metrics.jsonl`` of GRPO records.
        target: the PNG to write (written to a temporary name, then renamed).

    Returns:
        The PNG's path, or ``None`` when matplotlib is missing or no record has a reward.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render to a file
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no reward curve (pip install matplotlib)")
        return None
    records = read_metrics(metrics) if Path(metrics).is_file() else []
    rows = [r for r in records if _number(r.get("step")) is not None and _number(r.get("reward_mean")) is not None]
    if not rows:
        return None
    rows.sort(key=lambda r: r["step"])
    steps = [r["step"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    std = [_number(r.get("reward_std")) or 0.0 for r in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True)
    top.plot(steps, mean, label="reward_mean", linewidth=1.2)
    top.fill_between(
        steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25, label="+- reward_std"
    )
    # The held-out evaluations (step 0: the starting policy), where the run made them.
    evals = sorted(
        (r["step"], r["eval/reward_mean"])
        for r in records
        if _number(r.get("step")) is not None and _number(r.get("eval/reward_mean")) is not None
    )
    if evals:
        top.plot(*zip(*evals), "o-", label="eval/reward_mean (held-out)", linewidth=1.2, markersize=4)
    top.set_ylabel("reward")
    top.legend()
    for key, style in (("response_length", "-"), ("response_length_max", "--")):
        points = [(r["step"], r[key]) for r in rows if _number(r.get(key)) is not None]
        if points:
            bottom.plot(*zip(*points), style, label=key, linewidth=1.2)
    bottom.set_xlabel("step")
    bottom.set_ylabel("tokens")
    if bottom.lines:
        bottom.legend()
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    target = Path(target)
    tmp = target.with_name(target.stem + ".tmp.png")
    figure.savefig(tmp)
    plt.close(figure)
    os.replace(tmp, target)
    return target
