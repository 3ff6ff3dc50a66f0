"""RL runs side by side at equal generated tokens: reward and held-out accuracy against the tokens sampled.

    uv run --frozen python tools/rl_curves.py --run PPO=runs/ppo-tiny-cpu --run GRPO=runs/grpo-tiny-cpu \\
        --out docs/rl/ppo_vs_grpo.png

Each ``--run LABEL=DIR`` names a ``metrics.jsonl`` written by ``mindspeed-rl grpo`` / ``ppo`` (in
``DIR``, or the file itself). A step's generated tokens are ``rollout_tps * time/rollout`` (the
runner's own count: the response tokens of the step's batch), summed over the steps, so runs with
different group sizes or batches share one x axis. The top panel draws the training reward
(``reward_mean``, a moving mean over ``--smooth`` steps), the bottom the held-out accuracy
(``eval/reward_mean``, the step-0 evaluation at 0 tokens). A table of the numbers at the token
budget every run reached goes to standard output. Records are read with the core's
:func:`mindspeed.metrics.log.read_metrics`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mindspeed.metrics.log import METRICS_FILE, read_metrics


@dataclass
class RunCurve:
    """One run's curves: per training step the cumulative generated tokens and the reward; the evaluations."""

    label: str
    tokens: list[float]
    rewards: list[float]
    evals: list[tuple[float, float]]  # (cumulative tokens, eval/reward_mean)


def read_run(label: str, path: str | Path) -> RunCurve:
    """A run's curves from its ``metrics.jsonl`` (or the directory holding it).

    Raises:
        ValueError: one line: no such file, or no training step with the token count.
    """
    file = Path(path)
    file = file / METRICS_FILE if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"--run {label}={path}: no {METRICS_FILE} there; give a run's logging.dir")
    records = sorted(
        (r for r in read_metrics(file) if isinstance(r.get("step"), (int, float))), key=lambda r: r["step"]
    )
    tokens, rewards, evals, total = [], [], [], 0.0
    for record in records:
        if "reward_mean" in record:
            if "rollout_tps" not in record or "time/rollout" not in record:
                raise ValueError(f"--run {label}={path}: step {record['step']} has no rollout_tps/time/rollout")
            total += round(record["rollout_tps"] * record["time/rollout"])
            tokens.append(total)
            rewards.append(float(record["reward_mean"]))
        if isinstance(record.get("eval/reward_mean"), float):
            evals.append((total, record["eval/reward_mean"]))
    if not tokens:
        raise ValueError(f"--run {label}={path}: no training step in {file}; give a finished run's logging.dir")
    return RunCurve(label, tokens, rewards, evals)


def moving_mean(values: list[float], width: int) -> list[float]:
    """The mean of each value and the ``width - 1`` before it (fewer at the start)."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def at_budget(run: RunCurve, budget: float, width: int) -> tuple[float, float | None]:
    """The run's smoothed reward at the last step within ``budget`` tokens, and its held-out accuracy there.

    The held-out accuracy is interpolated linearly between the evaluations around ``budget``
    (``None`` when the run evaluated on neither side of it).
    """
    within = [i for i, t in enumerate(run.tokens) if t <= budget]
    reward = moving_mean(run.rewards, width)[within[-1] if within else 0]
    before = [(t, v) for t, v in run.evals if t <= budget]
    after = [(t, v) for t, v in run.evals if t > budget]
    if not before:
        return reward, None
    (t0, v0) = before[-1]
    if t0 == budget or not after:
        return reward, v0 if t0 == budget else None
    (t1, v1) = after[0]
    return reward, v0 + (v1 - v0) * (budget - t0) / (t1 - t0)


def summary(runs: list[RunCurve], width: int) -> str:
    """A table: each run's start and end, and its numbers at the token budget every run reached."""
    budget = min(run.tokens[-1] for run in runs)
    lines = [f"equal budget: {budget:.0f} generated tokens (the shortest run's total)"]
    lines.append("run | steps | tokens | reward first/last (mean of " + f"{width}) | held-out start/end | at budget")
    for run in runs:
        first = sum(run.rewards[:width]) / len(run.rewards[:width])
        last = sum(run.rewards[-width:]) / len(run.rewards[-width:])
        start = run.evals[0][1] if run.evals else float("nan")
        end = run.evals[-1][1] if run.evals else float("nan")
        reward, held = at_budget(run, budget, width)
        held_text = "-" if held is None else f"{held:.3f}"
        lines.append(
            f"{run.label} | {len(run.tokens)} | {run.tokens[-1]:.0f} | {first:.3f} -> {last:.3f} | "
            f"{start:.3f} -> {end:.3f} | reward {reward:.3f}, held-out {held_text}"
        )
    return "\n".join(lines)


def draw(runs: list[RunCurve], out: Path, width: int, title: str) -> Path:
    """Reward (top) and held-out accuracy (bottom) against cumulative generated tokens, one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=80, sharex=True)
    for run in runs:
        (line,) = top.plot(run.tokens, moving_mean(run.rewards, width), label=run.label, linewidth=1.4)
        top.plot(run.tokens, run.rewards, color=line.get_color(), alpha=0.2, linewidth=0.8)
        if run.evals:
            bottom.plot(*zip(*run.evals), "o-", color=line.get_color(), label=run.label, markersize=4)
    top.set_ylabel(f"training reward\n(mean of {width} steps)")
    bottom.set_ylabel("held-out accuracy")
    bottom.set_xlabel("generated tokens (cumulative)")
    top.set_title(title)
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.png")
    try:
        figure.savefig(tmp)
        os.replace(tmp, out)
    finally:
        plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=DIR", help="a run to draw")
    parser.add_argument("--out", type=Path, help="the PNG to write (none: only the table)")
    parser.add_argument("--smooth", type=int, default=5, help="steps in the reward's moving mean")
    parser.add_argument("--title", default="reward at equal generated tokens")
    args = parser.parse_args(argv)
    try:
        if args.smooth < 1:
            raise ValueError(f"--smooth {args.smooth} must be >= 1")
        runs = []
        for item in args.run:
            label, sep, path = item.partition("=")
            if not sep or not label or not path:
                raise ValueError(f"--run {item!r} must be LABEL=DIR, e.g. --run PPO=runs/ppo-tiny-cpu")
            runs.append(read_run(label, path))
    except ValueError as err:
        print(f"rl_curves: {err}", file=sys.stderr)
        return 2
    print(summary(runs, args.smooth))
    if args.out is not None:
        print(f"wrote {draw(runs, args.out, args.smooth, args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
