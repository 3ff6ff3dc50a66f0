"""``mindspeed features``: every registered feature, as text and JSON."""

from __future__ import annotations

import json
import logging

import pytest

from mindspeed.cli import main
from mindspeed.features import FEATURES
from mindspeed.log import PACKAGE_LOGGERS


@pytest.fixture(autouse=True)
def restore_logging():
    # main() calls setup_logging(), which binds a handler to capsys's stream; undo it afterwards.
    loggers = [logging.getLogger(name) for name in PACKAGE_LOGGERS]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def test_features_json_lists_every_feature(capsys) -> None:
    assert main(["features", "--json", "--optimization-level", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["optimization_level"] == 1 and data["accelerator"]
    assert [row["name"] for row in data["features"]] == FEATURES.keys()
    for row in data["features"]:
        feature = FEATURES.get(row["name"])
        assert row["level"] == feature.level and row["flags"] == list(feature.flags)
        assert row["enabled_by_default"] == bool(row["changes"]) or not feature.targets
        assert {"requires", "conflicts", "targets", "description", "why", "config"} <= set(row)
    assert main(["features", "--json", "--optimization-level", "0"]) == 0
    assert not any(row["enabled_by_default"] for row in json.loads(capsys.readouterr().out)["features"])


def test_features_text(capsys) -> None:
    assert main(["features"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FEATURES.keys()) and "--use-fused-rmsnorm" in out
