"""The feature report: text, JSON round trip, atomic write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed.features import BuildContext, FeatureReport, FeaturesConfig, ModelFacts, ParallelSizes, apply_features
from tests.core.features.toy import ToyFeature, registry_of, toy


def make_report() -> FeatureReport:
    class Hooked(ToyFeature):
        name = "hooked"
        level = 2

        def apply(self, cfg, ctx):
            return [
                ctx.add_hook("post_step", print, reason="toy hook"),
                ctx.set_config("offload", True),
                ctx.set_kernel("rms_norm", "native"),
                ctx.set_config("dtype", object()),
            ]

    context = BuildContext(
        accelerator="cpu",
        parallel=ParallelSizes(tp=2, dp=4),
        model=ModelFacts(normalization="RMSNorm", num_moe_experts=0),
    )
    registry = registry_of(toy("plain"), toy("off", level=2, default_on=False), Hooked)
    return apply_features(FeaturesConfig(optimization_level=2), context, registry=registry)


def test_report_lists_every_change_and_status() -> None:
    report = make_report()
    assert report.order == ["plain", "hooked"]
    assert [c.target for c in report.changes] == [
        "config_overrides.plain",
        "hooks.post_step",
        "config_overrides.offload",
        "kernel_impls.rms_norm",
        "config_overrides.dtype",
    ]
    text = report.render()
    assert "on  plain" in text and "off off" in text and "opt-in" in text
    assert all(c.describe() in text for c in report.changes)
    assert report.facts["parallel"] == {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 4, "vpp": 1}
    assert report.hooks == {"post_step": ["builtins.print"]}


def test_report_round_trips_through_json() -> None:
    report = make_report()
    data = json.loads(report.to_json())
    again = FeatureReport.from_dict(data)
    assert again.to_dict() == data
    assert [c.describe() for c in again.changes][:4] == [c.describe() for c in report.changes][:4]
    assert again.kernel_impls == {"rms_norm": "native"} and again.status("off").enabled is False


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = make_report()
    target = tmp_path / "run" / "features.json"
    assert report.write(target) == target
    assert json.loads(target.read_text()) == report.to_dict()
    assert [p.name for p in target.parent.iterdir()] == ["features.json"]

    # A failure mid-write keeps the old file and removes the temporary one.
    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("mindspeed.features.report.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        FeatureReport.from_dict({**report.to_dict(), "order": []}).write(target)
    assert [p.name for p in target.parent.iterdir()] == ["features.json"]
    assert json.loads(target.read_text())["order"] == report.order
