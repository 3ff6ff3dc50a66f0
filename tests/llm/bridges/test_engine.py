"""The engine maps every family's tiny checkpoint to megatron and back bit for bit, and refuses
checkpoints that do not match the rules, naming the leftovers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_llm.bridges import (
    bridge_for_architectures,
    hf_to_megatron,
    megatron_params,
    megatron_to_hf,
    plan_conversion,
)
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS


def _load(path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((path / "config.json").read_text())
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(shard))
    return config, state


def _plan(path, state=None):
    from transformers import AutoConfig

    config, loaded = _load(path)
    state = loaded if state is None else state
    bridge = bridge_for_architectures(config["architectures"])
    shape = bridge.shape_from_hf(AutoConfig.from_pretrained(path).to_dict())
    return plan_conversion(bridge, shape, {name: tuple(t.shape) for name, t in state.items()}), state


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_round_trip_is_bit_identical(tiny_checkpoints, family: str) -> None:
    plan, state = _plan(tiny_checkpoints[family])
    mg = hf_to_megatron(plan, state)
    expected = megatron_params(plan.shape)
    assert list(mg) == list(expected)
    assert {name: tuple(t.shape) for name, t in mg.items()} == {name: p.shape for name, p in expected.items()}
    back = megatron_to_hf(plan, mg)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_qkv_is_fused_in_query_group_order(tiny_checkpoints) -> None:
    # An independent statement of megatron's layout: for group g, rows are its heads' queries,
    # then its key head, then its value head.
    plan, state = _plan(tiny_checkpoints["qwen25"])
    shape = plan.shape
    d, groups = shape.kv_channels, shape.num_query_groups
    per_group = shape.num_attention_heads // groups
    fused = hf_to_megatron(plan, state)["decoder.layers.1.self_attention.linear_qkv.bias"]
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv")
    rows = []
    for g in range(groups):
        rows += [q[(g * per_group + h) * d : (g * per_group + h + 1) * d] for h in range(per_group)]
        rows += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    assert torch.equal(fused, torch.cat(rows))


def test_tied_output_layer_is_not_a_megatron_parameter(tiny_checkpoints) -> None:
    plan, _ = _plan(tiny_checkpoints["qwen25"])
    assert plan.shape.tie_embeddings and "output_layer.weight" not in plan.params
    plan, _ = _plan(tiny_checkpoints["llama2"])
    assert not plan.shape.tie_embeddings and "output_layer.weight" in plan.params


def test_unmatched_tensors_are_listed(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama2"]
    _, state = _load(path)
    stray = dict(
        state, **{"model.layers.0.mlp.extra_proj.weight": torch.zeros(2), "model.vision.weight": torch.zeros(2)}
    )
    with pytest.raises(
        ValueError,
        match=r"no rule of the llama2 bridge matches .*model\.layers\.0\.mlp\.extra_proj\.weight, model\.vision\.weight",
    ):
        _plan(path, stray)
    missing = {k: v for k, v in state.items() if k != "model.layers.3.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.3\.self_attn\.k_proj\.weight"):
        _plan(path, missing)
    # Old checkpoints' rotary buffers are dropped, not an error.
    buffers = dict(state, **{"model.layers.2.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    plan, _ = _plan(path, buffers)
    assert plan.dropped_hf == ["model.layers.2.self_attn.rotary_emb.inv_freq"]


def test_multi_token_prediction_layers_are_dropped(tiny_checkpoints) -> None:
    # DeepSeek-V3 checkpoints append MTP layers after the decoder layers; transformers ignores them.
    path = tiny_checkpoints["deepseek3"]
    _, state = _load(path)
    mtp = {"model.layers.4.eh_proj.weight": torch.zeros(64, 128), "model.layers.4.enorm.weight": torch.zeros(64)}
    plan, _ = _plan(path, dict(state, **mtp))
    assert plan.dropped_hf == sorted(mtp)
    assert plan.shape.moe_layer_freq == (0, 1, 1, 1) and plan.shape.moe_shared_expert_intermediate_size == 32


def test_shape_mismatch_names_the_tensor(tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen3"]
    _, state = _load(path)
    bad = dict(state, **{"model.layers.2.self_attn.k_proj.weight": torch.zeros(8, 64)})
    with pytest.raises(ValueError, match=r"shape mismatch in .*model\.layers\.2\.self_attn\.k_proj\.weight"):
        _plan(path, bad)
    wide = dict(
        state,
        **{
            "model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64),
            "model.layers.0.mlp.gate_proj.weight": torch.zeros(100, 64),
        },
    )
    with pytest.raises(
        ValueError,
        match=r"give decoder\.layers\.0\.mlp\.linear_fc1\.weight \(200, 64\) but config\.json implies \(192, 64\)",
    ):
        _plan(path, wide)


def test_derived_config_matches_the_source(tiny_checkpoints) -> None:
    # mg -> hf without a config.json at hand rebuilds one from the megatron shape alone.
    from transformers import AutoConfig

    for family, path in tiny_checkpoints.items():
        plan, _ = _plan(path)
        source = AutoConfig.from_pretrained(path).to_dict()
        derived = plan.bridge.hf_config_from_shape(plan.shape).to_dict()
        for key in ("architectures", "model_type"):
            assert derived[key] == source[key], (family, key)
        for key in plan.bridge.config_keys:  # equal values, defaults filled in (head_dim None == hidden / heads)
            assert key.read(derived) == key.read(source), (family, key.hf)
        assert plan.bridge.shape_from_hf(derived) == plan.shape, family


def test_glm45_without_biases_or_qk_norm_maps_without_them(tmp_path) -> None:
    # GLM-4.5 / 4.6 as released: attention_bias true, use_qk_norm false (the tiny config has both on).
    from transformers import AutoModelForCausalLM

    for bias, qk_norm in ((True, False), (False, False)):
        config = TINY_CONFIGS.get("glm45-moe")()
        config.attention_bias, config.use_qk_norm = bias, qk_norm
        path = tmp_path / f"b{int(bias)}"
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        plan, state = _plan(path)
        assert (plan.shape.add_qkv_bias, plan.shape.qk_layernorm) == (bias, qk_norm)
        mg = hf_to_megatron(plan, state)
        assert list(mg) == list(megatron_params(plan.shape))
        assert any(name.endswith("linear_qkv.bias") for name in mg) == bias
        assert not any("layernorm" in name and "self_attention" in name for name in mg)
        back = megatron_to_hf(plan, mg)
        assert sorted(back) == sorted(state) and all(torch.equal(back[n], t) for n, t in state.items())
    # Group scores: transformers sums a group's 2 best experts, megatron its best topk / topk_group.
    config = TINY_CONFIGS.get("glm45-moe")().to_dict() | {"num_experts_per_tok": 1}
    with pytest.raises(ValueError, match="num_experts_per_tok 1 / topk_group 1 is not 2"):
        bridge_for_architectures(["Glm4MoeForCausalLM"]).shape_from_hf(config)
