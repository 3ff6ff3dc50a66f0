"""Flow-GRPO runs (``mindspeed-rl flow-grpo``) drawn from their ``metrics.jsonl``: training reward and checks.

    uv run --frozen python tools/flow_grpo_curves.py --run "window [0,2], lr 2e-4=runs/w02-lr2e-4" \\
        --out docs/mm/flow_grpo_window_reward.png

Each ``--run LABEL=DIR`` names a run's output directory (or its ``metrics.jsonl``). The top panel draws each
iteration's training reward (faint) and its moving mean over ``--smooth`` iterations; the bottom one the held-out
checks (the records with ``eval``: the reward on the held-out captions with its standard error, ``reward_se``, and,
when the run checked the training captions too, ``train_reward`` dashed). A table of each run's first / last
rewards and its paired changes (``reward_gain`` +- ``reward_gain_se`` of the last check against the first, as
the run computed them) goes to standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FlowRun:
    """One run's iterations (``iteration``, ``reward``) and its check records."""

    label: str
    iterations: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)


def read_run(label: str, path: str | Path) -> FlowRun:
    """A run's curves from its ``metrics.jsonl`` (or the directory holding it).

    Raises:
        ValueError: one line: no such file, a line that is not JSON, or no iteration record.
    """
    file = Path(path)
    file = file / "metrics.jsonl" if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"--run {label}={path}: no metrics.jsonl there; give a flow-grpo --output-dir")
    run = FlowRun(label)
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--run {label}={path}: line {number} of {file} is not JSON ({err.msg})") from None
        if "eval" in record:
            run.checks.append(record)
        elif "reward" in record and "iteration" in record:
            run.iterations.append(int(record["iteration"]))
            run.rewards.append(float(record["reward"]))
    if not run.iterations:
        raise ValueError(f"--run {label}={path}: no iteration in {file}; give a run that trained")
    return run


def moving_mean(values: list[float], width: int) -> list[float]:
    """The mean of each value and the ``width - 1`` before it (fewer at the start)."""
    return [
        sum(values[max(0, i - width + 1) : i + 1]) / len(values[max(0, i - width + 1) : i + 1])
        for i in range(len(values))
    ]


def summary(runs: list[FlowRun], width: int) -> str:
    """Per run: iterations, training reward (mean of the first / last ``width``), the checks' start -> end and the
    paired changes of the last check (``-`` where the run did not record them)."""
    lines = [f"run | iterations | training reward first -> last {width} | held-out reward | paired changes (SE)"]
    for run in runs:
        first = sum(run.rewards[:width]) / len(run.rewards[:width])
        last = sum(run.rewards[-width:]) / len(run.rewards[-width:])
        held = "-"
        if run.checks:
            held = f"{run.checks[0]['reward']:.4f} -> {run.checks[-1]['reward']:.4f}"
        gains = []
        end = run.checks[-1] if run.checks else {}
        for prefix, name in (("", "held-out"), ("train_", "training captions")):
            if f"{prefix}reward_gain" in end:
                parts = [
                    f"{key} {end[f'{prefix}{key}_gain']:+.4f} ({end[f'{prefix}{key}_gain_se']:.4f})"
                    for key in ("reward", "colour", "position")
                ]
                gains.append(f"{name}: " + ", ".join(parts))
        lines.append(
            f"{run.label} | {run.iterations[-1]} | {first:.4f} -> {last:.4f} | {held} | {'; '.join(gains) or '-'}"
        )
    return "\n".join(lines)


def draw(runs: list[FlowRun], out: Path, width: int, title: str) -> Path:
    """Training reward (top) and the checks' rewards (bottom) against the iteration, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=80, sharex=True)
    for run in runs:
        (line,) = top.plot(run.iterations, moving_mean(run.rewards, width), label=run.label, linewidth=1.4)
        top.plot(run.iterations, run.rewards, color=line.get_color(), alpha=0.25, linewidth=0.8)
        if run.checks:
            x = [c["iteration"] for c in run.checks]
            bottom.errorbar(
                x, [c["reward"] for c in run.checks], yerr=[c.get("reward_se", 0.0) for c in run.checks],
                fmt="o-", color=line.get_color(), markersize=4, capsize=3, label=f"{run.label}: held-out",
            )  # fmt: skip
            if all("train_reward" in c for c in run.checks):
                bottom.plot(
                    x, [c["train_reward"] for c in run.checks], "s--", color=line.get_color(), markersize=3,
                    alpha=0.7, label=f"{run.label}: training captions",
                )  # fmt: skip
    top.set_ylabel(f"training reward\n(mean of {width} rounds)")
    bottom.set_ylabel("check reward (Euler,\nthe same noises; +- SE)")
    bottom.set_xlabel("iteration")
    top.set_title(title)
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
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
    parser.add_argument("--smooth", type=int, default=5, help="iterations in the reward's moving mean")
    parser.add_argument("--title", default="Flow-GRPO on the shapes demo")
    args = parser.parse_args(argv)
    try:
        if args.smooth < 1:
            raise ValueError(f"--smooth {args.smooth} must be >= 1")
        runs = []
        for item in args.run:
            label, sep, path = item.partition("=")
            if not sep or not label or not path:
                raise ValueError(f"--run {item!r} must be LABEL=DIR, e.g. --run window=runs/flow-grpo-t2i")
            runs.append(read_run(label, path))
    except ValueError as err:
        print(f"flow_grpo_curves: {err}", file=sys.stderr)
        return 2
    print(summary(runs, args.smooth))
    if args.out is not None:
        print(f"wrote {draw(runs, args.out, args.smooth, args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
