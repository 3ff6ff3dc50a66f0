"""tools/rl_curves.py: two runs on one axis of generated tokens, the numbers at the shared budget, bad input one line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    """tools/rl_curves.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("rl_curves", ROOT / "tools" / "rl_curves.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, tokens_per_step: int, rewards: list[float], evals: dict[int, float]) -> Path:
    """A metrics.jsonl as the runners write it: step 0's evaluation, then one record per step."""
    folder.mkdir()
    lines = [{"step": 0.0, "eval/reward_mean": evals[0]}]
    for step, reward in enumerate(rewards, 1):
        record = {"step": float(step), "reward_mean": reward, "rollout_tps": tokens_per_step / 0.3, "time/rollout": 0.3}
        if step in evals:
            record["eval/reward_mean"] = evals[step]
        lines.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_runs_share_the_token_axis_and_the_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    # PPO: 100 tokens a step for 4 steps; GRPO: 200 a step for 3 steps (equal budget: 400 tokens).
    ppo = _write(tmp_path / "ppo", 100, [0.1, 0.2, 0.3, 0.5], {0: 0.2, 2: 0.3, 4: 0.5})
    grpo = _write(tmp_path / "grpo", 200, [0.2, 0.4, 0.6], {0: 0.2, 1: 0.25, 3: 0.45})
    run = tool.read_run("PPO", ppo)
    assert run.tokens == [100, 200, 300, 400] and run.evals == [(0, 0.2), (200, 0.3), (400, 0.5)]
    other = tool.read_run("GRPO", grpo / "metrics.jsonl")  # the file itself works too
    assert other.tokens == [200, 400, 600]
    assert tool.moving_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    # GRPO at 400 tokens: its step-2 reward (mean of steps 1-2 with --smooth 2), its held-out
    # accuracy interpolated between 200 tokens (0.25) and 600 (0.45).
    reward, held = tool.at_budget(other, 400, 2)
    assert reward == pytest.approx(0.3) and held == pytest.approx(0.35)
    assert tool.at_budget(run, 400, 2) == (pytest.approx(0.4), 0.5)
    out = tmp_path / "curves.png"
    assert tool.main(["--run", f"PPO={ppo}", "--run", f"GRPO={grpo}", "--smooth", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "equal budget: 400 generated tokens" in printed
    assert "PPO | 4 | 400 | 0.150 -> 0.400 | 0.200 -> 0.500 | reward 0.400, held-out 0.500" in printed
    assert "GRPO | 3 | 600 | 0.300 -> 0.500 | 0.200 -> 0.450 | reward 0.300, held-out 0.350" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_runs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"step": 0.0, "eval/reward_mean": 0.2}) + "\n")
    cases = {
        "PPO": "--run 'PPO' must be LABEL=DIR",
        f"A={tmp_path / 'none'}": "no metrics.jsonl there; give a run's logging.dir",
        f"B={tmp_path / 'empty'}": "no training step in",
    }
    for arg, message in cases.items():
        assert tool.main(["--run", arg, "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()  # nothing written
