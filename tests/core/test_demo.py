"""The embedded-default job trains: its loss falls towards the data's noise floor."""

from __future__ import annotations

import json

from mindspeed.cli import main
from mindspeed.demo import DemoConfig, run_demo


def test_demo_loss_falls() -> None:
    result = run_demo(DemoConfig(steps=40, impl="reference"))
    assert result.last_loss < 0.6 * result.first_loss
    assert result.last_loss > result.floor * 0.9  # cannot beat the entropy of the data
    assert result.peak_memory_bytes > 0 and result.tokens_per_second > 0
    assert set(result.kernels.values()) == {"reference"}


def test_cli_demo_and_info(capsys) -> None:
    assert main(["demo", "steps=30", "log_interval=100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["last_loss"] < report["first_loss"]
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["accelerator"]["name"] in {"cpu", "cuda", "npu"}
    assert all(row["available"][-1] in row["registered"] for row in info["ops"].values())
    assert "reference" in info["ops"]["rms_norm"]["available"]


def test_cli_rejects_bad_overrides(capsys) -> None:
    assert main(["demo", "stepz=3"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err
    assert main(["demo", "model=no-such-model", "steps=1"]) == 2
    assert "unknown tiny model config 'no-such-model'" in capsys.readouterr().err
