"""tools/flow_grpo_curves.py: a Flow-GRPO run's rewards and checks from its metrics.jsonl, the table, the PNG, bad input."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    """tools/flow_grpo_curves.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("flow_grpo_curves", ROOT / "tools" / "flow_grpo_curves.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, rewards: list[float]) -> Path:
    """A metrics.jsonl as ``train_flow_grpo`` writes it: the start check, the rounds, the end check with gains."""
    folder.mkdir()
    lines = [{"eval": "start", "iteration": 0, "reward": 0.1, "reward_se": 0.01, "train_reward": 0.2}]
    lines += [{"iteration": i, "reward": r, "colour": 0.5, "position": 0.5} for i, r in enumerate(rewards, 1)]
    end = {"eval": "end", "iteration": len(rewards), "reward": 0.15, "reward_se": 0.01, "train_reward": 0.3}
    for prefix in ("", "train_"):
        for key, gain in (("reward", 0.05), ("colour", 0.0625), ("position", -0.03125)):
            end[f"{prefix}{key}_gain"], end[f"{prefix}{key}_gain_se"] = gain, 0.01
    lines.append(end)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_reads_draws_and_tabulates_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    run = tool.read_run("window", _write(tmp_path / "run", [0.1, 0.2, 0.3, 0.6]))
    assert run.iterations == [1, 2, 3, 4] and run.rewards == [0.1, 0.2, 0.3, 0.6] and len(run.checks) == 2
    assert tool.moving_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    out = tmp_path / "curve.png"
    assert tool.main(["--run", f"window={tmp_path / 'run'}", "--smooth", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "window | 4 | 0.1500 -> 0.4500 | 0.1000 -> 0.1500 | held-out: reward +0.0500 (0.0100)" in printed
    assert "colour +0.0625 (0.0100), position -0.0312 (0.0100); training captions: reward +0.0500" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    assert tool.main(["--run", f"x={tmp_path}"]) == 2
    assert "no metrics.jsonl there" in capsys.readouterr().err
    assert tool.main(["--run", "nolabel"]) == 2
    assert "must be LABEL=DIR" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"eval": "start", "iteration": 0, "reward": 0.1}\n')
    assert tool.main(["--run", f"x={tmp_path}"]) == 2
    assert "no iteration" in capsys.readouterr().err
