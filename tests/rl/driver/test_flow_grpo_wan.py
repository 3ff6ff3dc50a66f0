"""Flow-GRPO's loop on the Wan text-to-video demo's pipeline (``demo: t2v``, untrained tiny Wan, video latents
``[B, 12, 4, 12, 12]``) with a LoRA policy: a run stopped after one iteration and resumed by ``mindspeed-rl
flow-grpo`` ends bit-exact with the uninterrupted run (every LoRA factor, AdamW's state, every metric and held-out
record); AdamW holds the factors only, the KL reference is the same module (adapters off, no copy); the merged
export loaded by diffusers is the base weights of ``load_dir`` (unchanged) plus ``(alpha / r) B A`` of the saved
factors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mindspeed_mm.demos.t2v import write_demo_pipeline
from mindspeed_mm.models.wan import WAN
from mindspeed_rl.cli import main
from mindspeed_rl.driver.flow_grpo import STATE_FILE, FlowGRPOConfig, FlowGRPORun, check_policy_family, train_flow_grpo


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the demo's transformer is tiny, and on a loaded 2-core host two threads wait on each other
    (an iteration of this test took 10-24 s with two, 0.7 s with one, at load average 10)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_wan_lora_run_resumes_bit_exact_and_exports_merged(tmp_path) -> None:
    pipeline = write_demo_pipeline(tmp_path / "pipeline")
    config = FlowGRPOConfig(
        load_dir=str(pipeline / "transformer"),
        pipeline_dir=str(pipeline),
        demo="t2v",
        text_len=8,
        reward="video_brightness",
        iterations=2,
        prompts_per_iteration=2,
        group_size=2,
        mini_batches=2,
        sampling_steps=3,
        timestep_fraction=0.5,
        guidance_scale=1.0,  # Wan's guidance is proven in tests/rl/models/test_dit_policy_wan.py
        kl_coef=0.04,
        lr=1e-2,
        eval_seeds=1,
        eval_steps=2,
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=["default"],
        export_dir=str(tmp_path / "whole" / "hf"),
    )
    run = FlowGRPORun(config)
    assert run.reference.model is run.model  # the reference is the base inside the policy: no copy
    trained = [p for group in run.optimizer.param_groups for p in group["params"]]
    factors = {n for n, p in run.model.named_parameters() if ".lora_" in n}
    assert {n for n, p in run.model.named_parameters() if any(p is q for q in trained)} == factors
    assert run.shape == (12, 4, 12, 12) and len(factors) == 2 * 4 * 2 * 3
    held_out = run.evaluate()  # the t2v demo's checks on its 8 held-out captions
    assert set(held_out) == {"colour", "direction", "reward", "reward_se", "samples"}
    assert sorted(held_out["samples"]) == ["colour", "direction", "reward"]  # per sample, for paired gains
    del run

    whole = train_flow_grpo(config, tmp_path / "whole", evaluate=False)
    split = dataclasses.replace(config, export_dir=None)
    first = train_flow_grpo(split, tmp_path / "split", stop_after=1, evaluate=False)
    overrides = [f"{k}={v}" for k, v in dataclasses.asdict(split).items() if v is not None]
    assert main(["flow-grpo", "--output-dir", str(tmp_path / "split"), "--no-eval", *overrides]) == 0
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == whole and first == whole[:1] and "direction" in whole[0]
    assert whole[1]["kl"] > 0 and whole[0]["ratio_mean"] != 1.0  # the second mini-batch is off-policy

    a = torch.load(tmp_path / "whole" / STATE_FILE, weights_only=True)
    b = torch.load(tmp_path / "split" / STATE_FILE, weights_only=True)
    assert set(a["model"]) == set(b["model"]) and all(".lora_" in name for name in a["model"])
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][key][name]), (key, name)

    base = WAN.load_class().from_pretrained(str(pipeline / "transformer")).state_dict()
    merged = WAN.load_class().from_pretrained(config.export_dir).state_dict()
    assert set(merged) == set(base)
    changed = 0
    for name, value in merged.items():
        module = name.rsplit(".", 1)[0]
        lora_a = a["model"].get(f"{module}.lora_A.default.weight")
        if lora_a is None or not name.endswith(".weight"):
            assert torch.equal(value, base[name]), name  # not adapted: the base, untouched
            continue
        update = 8.0 / 4 * a["model"][f"{module}.lora_B.default.weight"] @ lora_a
        torch.testing.assert_close(value, base[name] + update, rtol=1e-6, atol=1e-7, msg=name)
        changed += bool(update.abs().max() > 0)
    assert changed == len(factors) // 2  # every adapted linear moved


def test_image_conditioned_wan_is_refused() -> None:
    from mindspeed_mm.models.wan_i2v import WAN_I2V
    from mindspeed_mm.models.wan_ti2v import WAN_TI2V

    for family in (WAN_I2V, WAN_TI2V):
        config = family.load_class().from_config(family.tiny_config).config
        with pytest.raises(ValueError, match="text-to-image and text-to-video transformers only"):
            check_policy_family(family, config, "some/dir")
    check_policy_family(WAN, WAN.load_class().from_config(WAN.tiny_config).config, "some/dir")
