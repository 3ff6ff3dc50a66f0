"""Typed configs from YAML and key=value overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from mindspeed.config import ConfigError, load_config, parse_overrides, to_dict


@dataclass
class ModelSection:
    num_layers: int = 2
    hidden_size: int = 64
    norm: Literal["rms_norm", "layer_norm"] = "rms_norm"


@dataclass
class TrainSection:
    lr: float = 1e-3
    steps: int = 10
    data_paths: list[str] = field(default_factory=list)
    resume: bool = False
    name: str | None = None
    window: tuple[int, ...] | None = None


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)


def test_yaml_then_overrides(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  num_layers: 4\ntrain:\n  lr: 3e-4\n  data_paths: [a, b]\n")
    cfg = load_config(Recipe, recipe, ["train.steps=7", "model.norm=layer_norm", "train.resume=true"])
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 64
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.train.steps == 7 and cfg.train.resume is True
    assert cfg.train.data_paths == ["a", "b"] and cfg.model.norm == "layer_norm"
    assert to_dict(cfg)["train"]["data_paths"] == ["a", "b"]


def test_unknown_key_suggests_the_closest(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'model.num_layer'.*did you mean 'model.num_layers'"):
        load_config(Recipe, None, ["model.num_layer=3"])
    with pytest.raises(ConfigError, match="unknown config key 'trian'"):
        load_config(Recipe, None, ["trian.steps=3"])


def test_wrong_types_name_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match="model.num_layers: expected an integer"):
        load_config(Recipe, None, ["model.num_layers=two"])
    with pytest.raises(ConfigError, match="model.norm: 'batch_norm' is not one of"):
        load_config(Recipe, None, ["model.norm=batch_norm"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Recipe, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(Recipe, bad)


def test_none_and_comma_lists_on_the_command_line() -> None:
    """``key=None`` (Python's spelling) is None for an optional setting as ``key=null`` is (it used to be the string
    'None': a path setting wrote a ./None directory); ``key=0,2`` gives the items' types as ``key=[0,2]`` does."""
    cfg = load_config(Recipe, None, ["train.name=x", "train.window=0,2", "train.data_paths=a,b"])
    assert cfg.train.name == "x" and cfg.train.window == (0, 2) and cfg.train.data_paths == ["a", "b"]
    for spelling in ("None", "null", "~"):
        cfg = load_config(Recipe, None, [f"train.name={spelling}", f"train.window={spelling}"])
        assert cfg.train.name is None and cfg.train.window is None, spelling
    assert load_config(Recipe, None, ["train.window=[1, 3]"]).train.window == (1, 3)
    with pytest.raises(ConfigError, match=r"train.window\[1\]: expected an integer"):
        load_config(Recipe, None, ["train.window=0,x"])
