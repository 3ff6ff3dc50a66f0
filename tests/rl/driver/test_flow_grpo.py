"""Flow-GRPO's training loop on the shapes demo's pipeline (untrained transformer, tiny rounds): a run stopped
after one iteration and resumed from its state file (by ``mindspeed-rl flow-grpo``) ends bit-exact with the uninterrupted run (every weight,
AdamW's state, every metric), and the update moved the weights. The untrained model draws no shapes (the
shapes reward would be 0 for every sample, so no advantage): the run's reward is a registered test reward,
the images' mean brightness (the registry is the hook a reward model plugs into)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mindspeed_mm.demos.t2i import write_t2i_pipeline
from mindspeed_rl.cli import main
from mindspeed_rl.driver.flow_grpo import STATE_FILE, FlowGRPOConfig, train_flow_grpo
from mindspeed_rl.rewards.image import IMAGE_REWARDS


def brightness():
    return lambda images, captions: images.mean(dim=(1, 2, 3))


def test_killed_and_resumed_run_is_bit_exact(tmp_path) -> None:
    pipeline = write_t2i_pipeline(tmp_path / "pipeline")
    config = FlowGRPOConfig(
        load_dir=str(pipeline / "transformer"),
        pipeline_dir=str(pipeline),
        iterations=2,
        prompts_per_iteration=2,
        group_size=2,
        mini_batches=2,
        sampling_steps=3,
        timestep_fraction=0.7,
        kl_coef=0.04,
        lr=1e-3,
        reward="test_brightness",
    )
    IMAGE_REWARDS.register("test_brightness", brightness)
    try:
        whole = train_flow_grpo(config, tmp_path / "whole", evaluate=False)
        first = train_flow_grpo(config, tmp_path / "split", stop_after=1, evaluate=False)
        overrides = [f"{k}={v}" for k, v in dataclasses.asdict(config).items() if v is not None]
        assert main(["flow-grpo", "--output-dir", str(tmp_path / "split"), "--no-eval", *overrides]) == 0
    finally:
        IMAGE_REWARDS.unregister("test_brightness")
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == whole and first == whole[:1]
    a = torch.load(tmp_path / "whole" / STATE_FILE, weights_only=True)
    b = torch.load(tmp_path / "split" / STATE_FILE, weights_only=True)
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][key][name]), (key, name)
    from diffusers import FluxTransformer2DModel

    start = FluxTransformer2DModel.from_pretrained(str(pipeline / "transformer")).state_dict()
    assert any(not torch.equal(start[name], value) for name, value in a["model"].items()), "the update moved nothing"
    assert whole[1]["kl"] > 0 and whole[0]["pg_clipfrac"] > 0  # the second mini-batch is off-policy


def test_sde_window_rounds_and_paired_checks(tmp_path) -> None:
    """With ``sde_window_size`` each round draws its window inside ``sde_window_range`` (recorded as
    ``sde_window_start``), the CLI takes the range as ``[start, end]``, bad windows are refused with the fix, and the
    checks' paired changes are the per-sample differences of the start and end checks (mean and SE by hand)."""
    pipeline = write_t2i_pipeline(tmp_path / "pipeline")
    config = FlowGRPOConfig(
        load_dir=str(pipeline / "transformer"),
        pipeline_dir=str(pipeline),
        reward="test_brightness",
        iterations=2,
        prompts_per_iteration=2,
        group_size=2,
        mini_batches=1,
        sampling_steps=4,
        same_noise=True,
        sde_window_size=1,
        sde_window_range=(1, 3),
        lr=3e-3,
        eval_seeds=2,
        eval_steps=2,
        eval_train_seeds=1,
    )
    for bad in ({"sde_window_size": 5}, {"sde_window_range": (2, 6)}, {"sde_window_range": (2,)}):
        with pytest.raises(ValueError, match="sde_window"):
            dataclasses.replace(config, **bad).validate()
    IMAGE_REWARDS.register("test_brightness", brightness)
    try:
        overrides = [
            f"{k}={v}" for k, v in dataclasses.asdict(config).items() if k != "sde_window_range" and v is not None
        ]
        assert main(["flow-grpo", "--output-dir", str(tmp_path / "run"), *overrides, "sde_window_range=[1, 3]"]) == 0
    finally:
        IMAGE_REWARDS.unregister("test_brightness")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if "eval" not in r]
    assert len(rounds) == 2 and all(r["sde_window_start"] in (1, 2) for r in rounds)
    start, end = (r for r in records if "eval" in r)
    assert len(start["samples"]["reward"]) == 8 * 2 and len(start["train_samples"]["colour"]) == 40
    for prefix in ("", "train_"):
        for key in ("reward", "colour", "position"):
            diff = torch.tensor(end[prefix + "samples"][key], dtype=torch.float64) - torch.tensor(
                start[prefix + "samples"][key], dtype=torch.float64
            )
            assert end[f"{prefix}{key}_gain"] == pytest.approx(float(diff.mean()), abs=1e-12)
            assert end[f"{prefix}{key}_gain_se"] == pytest.approx(float(diff.std()) / len(diff) ** 0.5, abs=1e-12)
    assert end["reward_gain"] != 0 and end["reward_gain"] == pytest.approx(end["reward"] - start["reward"], abs=1e-6)
