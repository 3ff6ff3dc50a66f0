"""GPT-OSS's released MXFP4 experts: dequantised exactly as transformers does, read by the bridge.

The tiny bf16 GPT-OSS model's expert weights are quantised in code (``quantize_mxfp4``) and
written the way the released checkpoints are (``*_blocks`` uint8 ``[experts, out, in / 32, 16]``
+ ``*_scales`` uint8 ``[experts, out, in / 32]``, biases in bf16).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mindspeed_llm.bridges.engine import hf_to_megatron, plan_conversion
from mindspeed_llm.bridges.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from mindspeed_llm.checkpoint.endpoints import HFSource
from mindspeed_llm.testing.tiny_models import build_tiny_model, write_tiny_tokenizer


def test_mxfp4_checkpoint_converts_as_transformers_dequantises(tmp_path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_tiny_model("gpt-oss", dtype=torch.bfloat16)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    quantised, dequantised = {}, dict(state)
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor)
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            theirs = convert_moe_packed_tensors(blocks, scales)  # transformers' own dequantisation
            ours = dequantize_mxfp4(blocks, scales)
            assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs), name
            # The quantisation is a real one: close to the weight, not equal to it.
            assert 0 < (ours.float() - tensor.float()).abs().max() <= tensor.float().abs().max() / 4
            dequantised[name] = theirs
        else:
            quantised[name] = tensor
    model.config.save_pretrained(tmp_path)
    save_file(quantised, tmp_path / "model.safetensors", metadata={"format": "pt"})
    write_tiny_tokenizer(tmp_path)

    source = HFSource(tmp_path)
    plan = plan_conversion(source.bridge, source.shape, source.hf_shapes())
    want = hf_to_megatron(plan, dequantised)
    # The same plan on the in-memory MXFP4 state dict, and on the files (streamed, per expert).
    from_state = hf_to_megatron(plan, quantised)
    experts = [task for task in plan.tasks if ".local_experts." in task.mg_name]
    assert len(experts) == 2 * 4 * 4  # 2 layers, 4 experts, fc1/fc2 weights and biases
    for task in plan.tasks:
        got = source.read(task, plan)
        assert got.dtype == want[task.mg_name].dtype and torch.equal(got, want[task.mg_name]), task.mg_name
        assert torch.equal(from_state[task.mg_name], want[task.mg_name]), task.mg_name


def test_a_cut_mxfp4_pair_is_refused() -> None:
    from mindspeed_llm.bridges import bridge_for_family
    from mindspeed_llm.bridges.stacked import unstack_shapes

    name = "model.layers.0.mlp.experts.down_proj"
    stacks = bridge_for_family("gpt-oss").hf_stacks
    shapes = unstack_shapes({name + "_blocks": (4, 64, 1, 16), name + "_scales": (4, 64, 1)}, stacks)
    assert shapes[name.replace("experts.", "experts.3.")] == (32, 64)  # [in, out] of one expert
    with pytest.raises(ValueError, match="down_proj_blocks has no .*down_proj_scales beside it"):
        unstack_shapes({name + "_blocks": (4, 64, 1, 16)}, stacks)
