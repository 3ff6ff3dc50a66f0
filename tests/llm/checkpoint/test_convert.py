"""Proofs (a) and (c) of convert-ckpt on every family's tiny checkpoint, and transformers loading the output.

(a) hf -> mg (TP2 PP2, EP2 for MoE; VPP, uneven stages and bf16 for some) -> hf gives bit-identical
    tensors, the same config.json and the same tokenizer and generation files.
(c) resharding a Megatron checkpoint (TP2 PP2 [EP2] -> TP1 PP1, and to TP2 PP2 VPP) gives exactly
    the files a direct conversion to that layout gives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mindspeed.checkpointing import block_io
from mindspeed_llm.bridges import bridge_for_family
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS, save_tiny_checkpoint

#: family -> extra target options of its round trip beyond the default (every family runs at TP2
#: PP2, MoE families at EP2 too).
SPECIAL_ROUND_TRIPS = {"llama2": {"num_layers_per_virtual_pipeline_stage": 1}, "mistral": {"num_layer_list": "3,1"}}


def round_trip_options(family: str) -> dict:
    """The target options of ``family``'s round trip (every registered family has one)."""
    if family in SPECIAL_ROUND_TRIPS:
        return SPECIAL_ROUND_TRIPS[family]
    return {"target_expert_parallel_size": 2} if bridge_for_family(family).capabilities.moe else {}


def convert(load: Path, save: Path, load_type: str = "hf", save_type: str = "mg", **options) -> Path:
    convert_checkpoint(
        ConvertConfig(
            load_model_type=load_type,
            save_model_type=save_type,
            load_dir=load,
            save_dir=save,
            progress=False,
            **options,
        )
    )
    return save


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in path.glob("*.safetensors"):
        state.update(load_file(file))
    return state


def megatron_files(path: Path) -> dict[str, dict]:
    return {str(f.relative_to(path)): torch.load(f, weights_only=False) for f in sorted(path.rglob("*.pt"))}


def assert_same_hf(back: Path, source: Path) -> None:
    got, want = hf_state(back), hf_state(source)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / name).read_bytes() == (source / name).read_bytes(), name


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_round_trip_through_megatron_is_bit_identical(tiny_checkpoints, tmp_path, family: str) -> None:
    source = tiny_checkpoints[family]
    mg = convert(
        source,
        tmp_path / "mg",
        target_tensor_parallel_size=2,
        target_pipeline_parallel_size=2,
        **round_trip_options(family),
    )
    back = convert(mg, tmp_path / "hf", "mg", "hf", max_shard_size="40KB")
    assert_same_hf(back, source)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected a sharded output"


@pytest.mark.parametrize("family", ["qwen25", "qwen3-moe"])
def test_rows_written_from_the_mappings_give_the_same_files(
    tiny_checkpoints, tmp_path, monkeypatch, family: str
) -> None:
    # The tiny models' rows are shorter than block_io.MIN_RUN_BYTES, so the round trips above
    # gather row-parallel pieces; here every row goes from the source mapping to the file.
    source, options = tiny_checkpoints[family], dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2)
    gathered = megatron_files(convert(source, tmp_path / "gathered", **options))
    monkeypatch.setattr(block_io, "MIN_RUN_BYTES", 1)
    direct = convert(source, tmp_path / "direct", **options)
    files = megatron_files(direct)
    assert sorted(files) == sorted(gathered)
    for file, state in gathered.items():
        for name, tensor in state["model"].items():
            assert (tensor is None and files[file]["model"][name] is None) or torch.equal(
                files[file]["model"][name], tensor
            )
    assert_same_hf(convert(direct, tmp_path / "hf", "mg", "hf"), source)


def test_bf16_checkpoint_keeps_its_dtype(tmp_path) -> None:
    source = tmp_path / "src"
    save_tiny_checkpoint("qwen3", source, dtype=torch.bfloat16)
    mg = convert(source, tmp_path / "mg", target_tensor_parallel_size=2)
    (rank,) = [v for k, v in megatron_files(mg).items() if "mp_rank_00" in k]
    assert rank["args"].bf16 and rank["args"].params_dtype == torch.bfloat16
    assert {t.dtype for t in rank["model"].values() if t is not None} == {torch.bfloat16}
    assert_same_hf(convert(mg, tmp_path / "hf", "mg", "hf"), source)


def test_megatron_files_record_layout_and_model(tiny_checkpoints, tmp_path) -> None:
    mg = convert(
        tiny_checkpoints["llama2"],
        tmp_path / "mg",
        target_tensor_parallel_size=2,
        target_pipeline_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1,
    )
    assert (mg / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    files = megatron_files(mg)
    assert sorted(files) == [f"iter_0000001/mp_rank_0{t}_00{p}/model_optim_rng.pt" for t in range(2) for p in range(2)]
    state = files["iter_0000001/mp_rank_01_001/model_optim_rng.pt"]
    args = state["args"]
    assert (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        args.num_layers,
        args.hidden_size,
        args.model_type_hf,
    ) == (2, 2, 1, 4, 64, "llama2")
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 1
    # Stage 1 holds global layers 1 (model0) and 3 (model1), each as local layer 0.
    assert (
        "decoder.layers.0.self_attention.linear_qkv.weight" in state["model0"]
        and "decoder.layers.1.mlp.linear_fc1.weight" not in state["model0"]
    )
    assert "output_layer.weight" in state["model1"] and "output_layer._extra_state" in state["model1"]
    assert (mg / "hf_config" / "config.json").read_bytes() == (tiny_checkpoints["llama2"] / "config.json").read_bytes()


@pytest.mark.parametrize("family,ep", [("qwen25", 1), ("llama2", 1), ("qwen3-moe", 2)])
def test_reshard_equals_direct_conversion(tiny_checkpoints, tmp_path, family: str, ep: int) -> None:
    source = tiny_checkpoints[family]
    tp2pp2 = convert(
        source,
        tmp_path / "tp2pp2",
        target_tensor_parallel_size=2,
        target_pipeline_parallel_size=2,
        target_expert_parallel_size=ep,
    )
    layouts = {
        "tp1pp1": {},
        "tp2pp2vpp": dict(
            target_tensor_parallel_size=2, target_pipeline_parallel_size=2, num_layers_per_virtual_pipeline_stage=1
        ),
    }
    for name, options in layouts.items():
        resharded = megatron_files(convert(tp2pp2, tmp_path / f"re-{name}", "mg", "mg", **options))
        direct = megatron_files(convert(source, tmp_path / f"direct-{name}", **options))
        assert sorted(resharded) == sorted(direct)
        for file, state in direct.items():
            other = resharded[file]
            assert vars(other["args"]) == vars(state["args"]), file
            for key in [k for k in state if k.startswith("model")]:
                assert list(other[key]) == list(state[key]), (file, key)
                for tensor_name, tensor in state[key].items():
                    if tensor is None:
                        assert other[key][tensor_name] is None
                    else:
                        assert torch.equal(other[key][tensor_name], tensor), (file, tensor_name)


def test_transformers_loads_the_output_without_warnings(tiny_checkpoints, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    for family in ("qwen25", "llama2"):
        source = tiny_checkpoints[family]
        mg = convert(source, tmp_path / family / "mg", target_tensor_parallel_size=2, target_pipeline_parallel_size=2)
        outputs = {"copied config": convert(mg, tmp_path / family / "hf", "mg", "hf")}
        # Without the kept config (a checkpoint from elsewhere): config derived from the args.
        shutil.rmtree(mg / "hf_config")
        outputs["derived config"] = convert(mg, tmp_path / family / "hf-derived", "mg", "hf")
        original = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
        with torch.no_grad():
            want = original(tokens).logits
        for label, path in outputs.items():
            model, info = AutoModelForCausalLM.from_pretrained(
                path, output_loading_info=True, attn_implementation="eager"
            )
            assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
                family,
                label,
                info,
            )
            with torch.no_grad():
                assert torch.equal(model.eval()(tokens).logits, want), (family, label)


@pytest.mark.parametrize("family", ["qwen25", "qwen3-moe"])
def test_torch_dist_round_trip_and_reshard(tiny_checkpoints, tmp_path, family: str) -> None:
    # megatron-core writes and reads the dist checkpoint (in this process, on one gloo rank).
    source = tiny_checkpoints[family]
    dist = convert(source, tmp_path / "dist", target_tensor_parallel_size=2, ckpt_format="torch_dist")
    assert (dist / "iter_0000001" / "metadata.json").is_file()
    assert_same_hf(convert(dist, tmp_path / "hf", "mg", "hf"), source)
    # dist -> per-rank TP2 PP2 equals the direct conversion.
    options = dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2)
    resharded = megatron_files(convert(dist, tmp_path / "re", "mg", "mg", **options))
    direct = megatron_files(convert(source, tmp_path / "direct", **options))
    for file, state in direct.items():
        for name, tensor in state["model"].items():
            assert (tensor is None and resharded[file]["model"][name] is None) or torch.equal(
                resharded[file]["model"][name], tensor
            )
