"""A LoRA Flow-GRPO run on the FLUX shapes demo's pipeline (``demo: t2i``, the family's default targets, which
include FLUX's text-stream projections): AdamW holds the factors only, and the merged export loaded by diffusers is
``load_dir``'s base weights (the unadapted ones bit-identical) plus ``(alpha / r) B A`` of the saved factors."""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel

from mindspeed_mm.demos.t2i import write_t2i_pipeline
from mindspeed_rl.driver.flow_grpo import STATE_FILE, FlowGRPOConfig, train_flow_grpo


def test_flux_lora_run_trains_the_factors_and_exports_merged(tmp_path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: see tests/rl/driver/test_flow_grpo_wan.py
    try:
        pipeline = write_t2i_pipeline(tmp_path / "pipeline")
        config = FlowGRPOConfig(
            load_dir=str(pipeline / "transformer"),
            pipeline_dir=str(pipeline),
            reward="brightness",
            iterations=1,
            prompts_per_iteration=2,
            group_size=2,
            mini_batches=2,
            sampling_steps=3,
            guidance_scale=1.0,
            kl_coef=0.04,
            lr=1e-2,
            lora_rank=4,
            lora_alpha=8.0,
            lora_target_modules=["default"],
            export_dir=str(tmp_path / "hf"),
        )
        records = train_flow_grpo(config, tmp_path / "run", evaluate=False)
    finally:
        torch.set_num_threads(threads)
    assert records[0]["kl"] > 0
    state = torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)
    assert state["model"] and all(".lora_" in name for name in state["model"])
    assert {n for n in state["model"] if n.endswith("lora_A.default.weight") and ".add_q_proj." in n}
    base = FluxTransformer2DModel.from_pretrained(str(pipeline / "transformer")).state_dict()
    merged = FluxTransformer2DModel.from_pretrained(config.export_dir).state_dict()
    assert set(merged) == set(base)
    adapted = 0
    for name, value in merged.items():
        module = name.rsplit(".", 1)[0]
        lora_a = state["model"].get(f"{module}.lora_A.default.weight")
        if lora_a is None or not name.endswith(".weight"):
            assert torch.equal(value, base[name]), name
            continue
        update = 8.0 / 4 * state["model"][f"{module}.lora_B.default.weight"] @ lora_a
        assert float(update.abs().max()) > 0, name
        torch.testing.assert_close(value, base[name] + update, rtol=1e-6, atol=1e-7, msg=name)
        adapted += 1
    assert 2 * adapted == len(state["model"])
