"""The recipe: strict sections with suggestions, --print-config, checks naming the key and the fix."""

from __future__ import annotations

import pytest
import yaml

from mindspeed.config import ConfigError
from mindspeed_mm.cli import main
from mindspeed_mm.config import SECTIONS, MMConfig, load_mm_config


def test_sections_and_overrides(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 2e-5\n  loss_type: per_token\nmodel:\n  freeze: [vision_tower]\n")
    config = load_mm_config(recipe, ["train.steps=7", "parallel.fsdp_plan=[model.visual]"])
    assert (config.train.lr, config.train.loss_type, config.train.steps) == (2e-5, "per_token", 7)
    assert config.model.freeze == ["vision_tower"] and config.parallel.fsdp_plan == ["model.visual"]
    assert tuple(f for f in MMConfig.__dataclass_fields__) == SECTIONS


def test_unknown_keys_suggest(tmp_path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'train.micro_batch_size'"):
        load_mm_config(None, ["train.micro_batch=2"])
    with pytest.raises(ConfigError, match="is not one of"):
        load_mm_config(None, ["train.loss_type=mean"])


def test_print_config(capsys, tmp_path) -> None:
    assert main(["train", "--print-config", "train.steps=3", "data.cutoff_len=64"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert list(printed) == list(SECTIONS) and printed["train"]["steps"] == 3 and printed["data"]["cutoff_len"] == 64


def test_checks_name_the_key(tmp_path, capsys) -> None:
    assert main(["train", "train.steps=1"]) == 2
    assert "model.path is unset" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    config = load_mm_config(
        None, [f"model.path={tmp_path}", "parallel.dp_replicate=3", f"data.files=[{tmp_path / 'config.json'}]"]
    )
    with pytest.raises(ConfigError, match="parallel.dp_replicate=3"):
        config.check(2)
    base = [f"model.path={tmp_path}", f"data.files=[{tmp_path / 'config.json'}]"]
    for extra, message in (
        (["lora.save_peft=x"], "lora.save_peft needs LoRA: set lora.target_modules"),
        (["lora.target_modules=[q_proj]", "model.freeze=[vision_tower]"], "model.freeze with LoRA"),
        (["lora.alpha=0"], "lora.alpha=0.0 must be positive"),
        (["data.video_min_pixels=70000"], "data.video_min_pixels=70000 is above data.video_max_pixels=65536"),
        (["data.video_fps=0"], "data.video_fps=0.0 must be positive"),
        (["data.workers=-1"], "data.workers=-1 not negative"),
        (["parallel.context_parallel_algo=megatron_cp_algo"], "vision-language models take ulysses_cp_algo only"),
        (["eval.interval=10"], "eval.interval=10 needs held-out data: set data.valid_files"),
        (["data.valid_files=[nope.jsonl]"], "data.valid_files: 'nope.jsonl' does not exist"),
        (["eval.iters=0"], "eval.iters=0 must be at least 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_mm_config(None, base + extra).check(1)
    with pytest.raises(ConfigError, match="parallel.dp_replicate=1 x parallel.ulysses_parallel_size=4"):
        load_mm_config(None, base + ["parallel.ulysses_parallel_size=4"]).check(2)
    with pytest.raises(ConfigError, match="needs model.attn_implementation=mindspeed"):
        load_mm_config(None, base + ["parallel.ulysses_parallel_size=2", "model.attn_implementation=sdpa"]).check(2)
    dit = tmp_path / "dit"  # a diffusers directory: no validation loss (yet)
    dit.mkdir()
    (dit / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
    for extra in (f"data.valid_files=[{tmp_path / 'config.json'}]", "eval.interval=5"):
        with pytest.raises(ConfigError, match="is a diffusion transformer, which has no validation loss yet"):
            load_mm_config(None, [f"model.path={dit}", f"data.files=[{tmp_path / 'config.json'}]", extra]).check(1)


def test_shipped_recipes_parse() -> None:
    from pathlib import Path

    for recipe in sorted((Path(__file__).resolve().parents[2] / "examples" / "mm").glob("*.yaml")):
        config = load_mm_config(recipe)
        assert config.model.path and (config.data.files or config.data.features), recipe


def test_long_video_recipe_validates(tmp_path, monkeypatch) -> None:
    """examples/mm/t2v_long_sp2.yaml: its demo resolves (built here in a temporary folder) to the measured Wan and
    long latents, and the recipe passes the checks of a 2-rank run (Ulysses 2, the heads divide) but not 1 or 3."""
    from pathlib import Path

    from mindspeed_mm.data.features import FeatureSet
    from mindspeed_mm.demos import t2v_long as demo_long
    from mindspeed_mm.demos.names import resolve_demo

    monkeypatch.setattr(demo_long, "DEFAULT_CACHE_DIR", tmp_path)
    recipe = Path(__file__).resolve().parents[2] / "examples" / "mm" / "t2v_long_sp2.yaml"
    raw = load_mm_config(recipe)
    assert (raw.model.path, raw.data.features) == (demo_long.T2V_LONG, demo_long.T2V_LONG)
    config = resolve_demo(raw)
    assert Path(config.model.path).parent.parent == tmp_path
    assert config.parallel.ulysses_parallel_size == 2 and config.data.text_len == demo_long.LONG_TEXT_LEN
    model = yaml.safe_load((Path(config.model.path) / "config.json").read_text())
    assert model["num_attention_heads"] % 2 == 0 and model["num_layers"] == demo_long.LONG_WAN["num_layers"]
    shapes = FeatureSet(config.data.features).shapes()
    assert shapes == [demo_long.LONG_SHAPE] * demo_long.NUM_CLIPS
    config.check(2)
    assert config.task() == "dit" and config.samples_per_step(2) == 1  # one group of 2 ranks: one clip a step
    for world in (1, 3):
        with pytest.raises(ConfigError):
            config.check(world)
