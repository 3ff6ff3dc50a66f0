"""RL metrics sinks: JSONL and TensorBoard read back, resume truncation, reward.png, console line, per-device rates."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import time
from pathlib import Path

import pytest

from mindspeed_rl.driver.metrics import (
    REWARD_CURVE,
    TENSORBOARD_DIR,
    ProgressLine,
    RLMetricsLog,
    format_step,
    per_device,
    read_metrics,
    write_reward_curve,
)


def make_record(step: int, scale: float = 1.0) -> dict[str, float]:
    """A grpo_step-shaped record whose values depend on the step (and ``scale``, to tell runs apart)."""
    return {
        "step": float(step),
        "reward_mean": 0.1 * step * scale,
        "reward_std": 0.05 * step,
        "reward/math": 0.2 * step,
        "response_length": 10.0 + step,
        "response_length_max": 20.0 + step,
        "loss": -0.01 * step * scale,
        "kl_loss": 0.001 * step,
        "pg_clipfrac": 0.02,
        "time/rollout": 1.5,
        "time/step": 2.0 + step,
        "e2e_tps": 400.0 * step,
        "rollout_tps": 800.0,
        "update_tps": 600.0,
    }


def read_board(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard shows: tag -> {step: value} (the last event of a step wins, as in the UI)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step shown twice {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def test_jsonl_tensorboard_and_curve_read_back(tmp_path) -> None:
    records = [make_record(s) for s in (1, 2, 3)]
    records[1]["loss"] = float("nan")  # a skipped step: "nan" in the JSONL, no TensorBoard point
    sink = RLMetricsLog(tmp_path, tensorboard=True, reward_curve=True)
    for record in records:
        sink.log(record)
    # Flushed per line: readable before close.
    assert [r["step"] for r in read_metrics(sink.path)] == [1.0, 2.0, 3.0]
    png = sink.close()
    got = read_metrics(tmp_path / "metrics.jsonl")
    assert got[1]["loss"] == "nan"
    for want, line in zip(records, got):
        for key, value in want.items():
            assert line[key] == value or (math.isnan(value) and line[key] == "nan")
    board = read_board(tmp_path / TENSORBOARD_DIR)
    assert set(board) == set(records[0]) - {"step"}
    for key in ("reward_mean", "reward/math", "time/step", "e2e_tps"):
        assert board[key] == pytest.approx({s: records[s - 1][key] for s in (1, 2, 3)})
    assert board["loss"] == pytest.approx({1: -0.01, 3: -0.03})
    assert png == tmp_path / REWARD_CURVE and png.stat().st_size > 1000
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 400 and image.shape[1] > 400  # two panels, 7x6 in at 100 dpi
    with pytest.raises(ValueError, match="numeric 'step'"):
        RLMetricsLog(tmp_path / "other", tensorboard=False, reward_curve=False).log({"reward_mean": 1.0})


def test_resume_drops_later_records_in_jsonl_and_tensorboard(tmp_path) -> None:
    with RLMetricsLog(tmp_path, tensorboard=True, reward_curve=False) as first:
        for step in range(1, 6):
            first.log(make_record(step))
    # Killed after step 5, resumed from the checkpoint of step 3: steps 4 and 5 are redone.
    with RLMetricsLog(tmp_path, tensorboard=True, reward_curve=True, resume_step=3) as second:
        for step in range(4, 7):
            second.log(make_record(step, scale=-1.0))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    want = {s: make_record(s, scale=1.0 if s <= 3 else -1.0)["reward_mean"] for s in range(1, 7)}
    assert {int(r["step"]): r["reward_mean"] for r in records} == want
    assert read_board(tmp_path / TENSORBOARD_DIR)["reward_mean"] == pytest.approx(want)
    assert (tmp_path / REWARD_CURVE).stat().st_size > 1000
    # A new run (resume_step 0) starts the file afresh.
    RLMetricsLog(tmp_path, tensorboard=False, reward_curve=False).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_reward_curve_needs_rewards(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert write_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "r.png") is None
    assert not (tmp_path / "r.png").exists()


def test_format_step_line() -> None:
    record = {**make_record(3), "entropy": 1.2345, "staleness_mean": 0.5, "tools/calls": 1.25}
    line = format_step(record, 10)
    assert line == (
        "step 3/10 | reward 0.300+-0.150 | len 13.0 | loss -0.03 | kl 0.003 | ent 1.234 | clip 0.020 | "
        "stale 0.50 | calls 1.25 | 1200 tok/s | 5.00 s"
    )
    moe = format_step({**record, "load_balancing_loss": 1.01234}, 10)  # a MoE policy's
    assert moe == line.replace("clip 0.020 | ", "clip 0.020 | lb 1.012 | ")
    sparse = format_step({"step": 2, "reward_mean": 1.0, "loss": float("nan")}, 0)
    assert sparse == "step 2 | reward 1.000"


def test_per_device_divides_the_token_rates() -> None:
    record = make_record(2)
    out = per_device(record, 4)
    assert (out["e2e_tps"], out["rollout_tps"], out["update_tps"]) == (200.0, 200.0, 150.0)
    assert {k: v for k, v in out.items() if not k.endswith("_tps")} == {
        k: v for k, v in record.items() if not k.endswith("_tps")
    }
    assert record["e2e_tps"] == 800.0  # the input is not changed
    assert per_device({"step": 1.0}, 2) == {"step": 1.0}
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_devices"):
            per_device(record, bad)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_plain_lines_off_a_terminal(caplog) -> None:
    stream = io.StringIO()  # what stderr is in CI: not a terminal
    with caplog.at_level(logging.INFO, logger="mindspeed_rl.driver.metrics"):
        with ProgressLine(4, bar=True, stream=stream, interval=2) as progress:
            assert not progress.uses_bar
            lines = [progress.update(make_record(s)) for s in (1, 2, 3, 4)]
    assert stream.getvalue() == ""
    logged = [r.getMessage() for r in caplog.records if r.name == "mindspeed_rl.driver.metrics"]
    assert logged == [lines[1], lines[3]]


def last_drawn_line(stream: io.StringIO) -> str:
    """The bar's final state as a terminal shows it (colours and cursor moves removed)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())
    return [line for line in re.split(r"[\r\n]", text) if line.strip()][-1]


def test_progress_line_bar_on_a_terminal() -> None:
    stream = FakeTerminal()
    progress = ProgressLine(3, bar=True, stream=stream)
    assert progress.uses_bar
    for step in (1, 2, 3):
        progress.update(make_record(step))
    progress.close()
    progress.close()  # twice is harmless
    shown = last_drawn_line(stream)
    assert shown.startswith("grpo ") and "3/3" in shown and "ETA" in shown and "reward 0.300+-0.150 | len" in shown
    assert "step 3/3" not in shown  # the bar's own count says it


@pytest.mark.parametrize("columns", [80, 60])
def test_progress_line_keeps_steps_and_eta_on_a_narrow_terminal(monkeypatch, columns: int) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    stream = FakeTerminal()
    with ProgressLine(300, bar=True, stream=stream, start=40) as progress:
        for step in (41, 42):
            progress.update(make_record(step))
            time.sleep(0.01)
    shown = last_drawn_line(stream)
    assert len(shown) <= columns and " 42/300 " in shown and re.search(r"ETA \d+:\d\d:\d\d", shown), shown
    assert ("reward 4.200+-2.100" in shown) == (columns == 80), shown  # the reward goes first, then the bar


def test_tensorboard_on_a_full_disk_warns_once_and_stops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import os

    from mindspeed_rl.driver.metrics import RLMetricsLog

    class _Full:
        name = "tensorboard"

        def log_scalars(self, *args: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        close = log_scalars

    sink = RLMetricsLog(tmp_path, tensorboard=False, reward_curve=False)
    sink.tracking.trackers.append(_Full())
    with caplog.at_level(logging.WARNING):
        for step in range(1, 20):
            sink.log({"step": step, "reward_mean": 0.5})
        sink.close()
    assert len([r for r in caplog.records if "tracker tensorboard failed" in r.getMessage()]) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 19


def test_held_out_evaluation_on_the_console_and_the_curve(tmp_path) -> None:
    """The held-out ``eval/reward_mean`` (step 0: the starting policy) shows on the console and in reward.png."""
    import matplotlib.image

    assert format_step({"step": 0, "eval/reward_mean": 0.26}, 60) == "step 0/60 | eval 0.260"
    line = format_step({**make_record(3), "eval/reward_mean": 0.5}, 10)
    assert line.startswith("step 3/10 | reward 0.300+-0.150 | eval 0.500 | len 13.0")
    plain = [make_record(s) for s in (1, 2, 3)]
    evaluated = [{"step": 0, "eval/reward_mean": 0.1}, *plain[:2], {**plain[2], "eval/reward_mean": 0.9}]
    images = []
    for name, records in (("plain", plain), ("evaluated", evaluated)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        images.append(matplotlib.image.imread(write_reward_curve(path, tmp_path / f"{name}.png")))
    assert images[0].shape == images[1].shape and (images[0] != images[1]).any()  # the eval line is drawn
