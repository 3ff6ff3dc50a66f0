"""DeepSeek-V3 multi-token-prediction (MTP) layers through convert-ckpt (``--mtp-num-layers``).

- The tiny source checkpoint has the layout transformers' own ``MtpModel`` loads (so the
  mapping is checked against transformers, not against itself).
- hf -> mg (TP2 PP2 EP2) -> hf with the MTP layers is bit-identical, copies of the embedding and
  the output head included; mg -> mg resharding keeps them; megatron-core writes and reads them in
  its dist format (its own ``GPTModel`` with the MTP block loads the converted tensors strictly).
- Without the flag they are dropped (as before); bad requests fail with one clear line.
- GLM-4.5 keeps its MTP layers in DeepSeek's layout: transformers' ``MtpModel`` loads the tiny
  source, and the TP2 PP2 EP2 round trip is bit-identical.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint

from .conftest import MTP_LAYERS
from .test_convert import assert_same_hf, convert, hf_state, megatron_files

TP2PP2EP2 = dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2, target_expert_parallel_size=2)


def test_source_layout_is_what_transformers_loads(tiny_mtp_checkpoint) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(tiny_mtp_checkpoint)
    # transformers lists DeepSeek-V3's MTP layer by its released index (61); the tiny model has 4 layers.
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.[4-9].*"]
    mtp = MtpModel.from_pretrained(main)  # raises when any MTP weight is missing
    assert len(mtp.layers) == MTP_LAYERS
    state = hf_state(tiny_mtp_checkpoint)
    for index, layer in enumerate(mtp.layers):
        prefix = f"model.layers.{4 + index}."
        assert torch.equal(layer.eh_proj.weight, state[prefix + "eh_proj.weight"])
        assert torch.equal(layer.post_norm.weight, state[prefix + "shared_head.norm.weight"])
        assert torch.equal(layer.mtp_block.self_attn.kv_b_proj.weight, state[prefix + "self_attn.kv_b_proj.weight"])


def test_round_trip_with_mtp_layers_is_bit_identical(tiny_mtp_checkpoint, tmp_path) -> None:
    mg = convert(tiny_mtp_checkpoint, tmp_path / "mg", mtp_num_layers=MTP_LAYERS, **TP2PP2EP2)
    files = megatron_files(mg)
    last = files["iter_0000001/mp_rank_01_001_001/model_optim_rng.pt"]
    assert last["args"].mtp_num_layers == MTP_LAYERS
    model = last["model"]
    assert "mtp.layers.1.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight" in model
    # The MTP stage keeps a copy of the embedding (megatron ties it to the first stage's).
    first = files["iter_0000001/mp_rank_01_000_001/model_optim_rng.pt"]["model"]
    assert torch.equal(model["embedding.word_embeddings.weight"], first["embedding.word_embeddings.weight"])
    assert not any(name.startswith("mtp.") for name in first)
    # eh_proj is column-parallel: rank 1 holds the second half of its rows.
    source = hf_state(tiny_mtp_checkpoint)
    assert torch.equal(model["mtp.layers.0.eh_proj.weight"], source["model.layers.4.eh_proj.weight"][32:])
    back = convert(mg, tmp_path / "hf", "mg", "hf", max_shard_size="100KB")
    assert_same_hf(back, tiny_mtp_checkpoint)
    # mg -> mg: the MTP layers follow the reshard.
    resharded = convert(mg, tmp_path / "tp1", "mg", "mg")
    assert_same_hf(convert(resharded, tmp_path / "hf1", "mg", "hf"), tiny_mtp_checkpoint)


def test_mtp_layers_in_megatron_core_dist_format(tiny_mtp_checkpoint, tmp_path) -> None:
    # megatron-core builds GPTModel with its MTP block, loads the converted tensors strictly and
    # saves them through its sharded state dict; reading back gives the source again.
    dist = convert(tiny_mtp_checkpoint, tmp_path / "dist", mtp_num_layers=1, ckpt_format="torch_dist")
    back = convert(dist, tmp_path / "hf", "mg", "hf")
    got, want = hf_state(back), hf_state(tiny_mtp_checkpoint)
    assert "model.layers.4.eh_proj.weight" in got and not any(name.startswith("model.layers.5.") for name in got)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_without_the_flag_mtp_layers_are_dropped(tiny_mtp_checkpoint, tmp_path) -> None:
    report = convert_checkpoint(
        ConvertConfig(load_dir=tiny_mtp_checkpoint, save_dir=tmp_path / "none", progress=False, dry_run=True)
    )
    assert "model.layers.4.eh_proj.weight" in report.dropped and "model.layers.5.enorm.weight" in report.dropped
    one = convert(tiny_mtp_checkpoint, tmp_path / "one", mtp_num_layers=1)
    (state,) = megatron_files(one).values()
    assert any(name.startswith("mtp.layers.0.") for name in state["model"])
    assert not any(name.startswith("mtp.layers.1.") for name in state["model"])
    none = convert(tiny_mtp_checkpoint, tmp_path / "zero", mtp_num_layers=0)
    (state,) = megatron_files(none).values()
    assert not any(name.startswith("mtp.") for name in state["model"]) and state["args"].mtp_num_layers is None


def test_bad_mtp_requests_fail_clearly(tiny_mtp_checkpoint, tiny_checkpoints, tmp_path) -> None:
    with pytest.raises(ValueError, match="--mtp-num-layers 3: config.json's num_nextn_predict_layers is 2"):
        convert(tiny_mtp_checkpoint, tmp_path / "a", mtp_num_layers=3)
    with pytest.raises(ValueError, match="llama2 bridge has no multi-token-prediction layers"):
        convert(tiny_checkpoints["llama2"], tmp_path / "b", mtp_num_layers=1)
    # The tiny DeepSeek checkpoint without MTP weights, with config.json announcing one MTP layer.
    with pytest.raises(ValueError, match="lacks tensors .* model.layers.4.eh_proj.weight"):
        convert(tiny_checkpoints["deepseek3"], tmp_path / "c", mtp_num_layers=1)
    mg = convert(tiny_mtp_checkpoint, tmp_path / "mg", mtp_num_layers=1)
    with pytest.raises(ValueError, match="holds 1 multi-token-prediction layers"):
        convert(mg, tmp_path / "d", "mg", "hf", mtp_num_layers=2)
    assert not any(tmp_path.glob("[abcd]"))


def test_a_copy_that_differs_is_refused(tiny_mtp_checkpoint, tmp_path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for file in tiny_mtp_checkpoint.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.4.shared_head.head.weight"
    shard = source / index[name]
    state = load_file(shard)
    state[name] = state[name] + 1
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name} differs from lm_head.weight"):
        convert(source, tmp_path / "out", mtp_num_layers=1)
    assert not (tmp_path / "out").exists()


def test_glm45_mtp_layers_load_in_transformers_and_round_trip(tiny_glm45_mtp_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(tiny_glm45_mtp_checkpoint)
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.[4-9].*"]
    mtp = MtpModel.from_pretrained(main)  # raises when any MTP weight is missing
    state = hf_state(tiny_glm45_mtp_checkpoint)
    assert len(mtp.layers) == MTP_LAYERS
    for index, layer in enumerate(mtp.layers):
        prefix = f"model.layers.{4 + index}."
        assert torch.equal(layer.eh_proj.weight, state[prefix + "eh_proj.weight"])
        assert torch.equal(layer.mtp_block.self_attn.q_proj.bias, state[prefix + "self_attn.q_proj.bias"])
    mg = convert(tiny_glm45_mtp_checkpoint, tmp_path / "mg", mtp_num_layers=MTP_LAYERS, **TP2PP2EP2)
    last = megatron_files(mg)["iter_0000001/mp_rank_01_001_001/model_optim_rng.pt"]["model"]
    assert "mtp.layers.1.transformer_layer.self_attention.linear_qkv.bias" in last
    assert "mtp.layers.1.transformer_layer.mlp.router.expert_bias" in last
    assert_same_hf(convert(mg, tmp_path / "hf", "mg", "hf", max_shard_size="100KB"), tiny_glm45_mtp_checkpoint)
