"""Proof (d): a Megatron LoRA adapter (random, non-zero) merged by convert-ckpt gives the logits
peft gives with the same adapter exported to PEFT, merged or not; merging keeps the base dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_llm.bridges import ParallelLayout, bridge_for_family
from mindspeed_llm.bridges.megatron_params import megatron_params
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.checkpoint.lora import lora_param, write_lora_checkpoint
from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

RANK, ALPHA = 4, 8.0


def _convert(**options) -> None:
    convert_checkpoint(ConvertConfig(progress=False, **options))


def _lora(shape, path: Path, layout: ParallelLayout, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    factors = {}
    for param in megatron_params(shape).values():
        if param.name.endswith(".weight") and param.module.rsplit(".", 1)[-1] in (
            "linear_qkv",
            "linear_proj",
            "linear_fc1",
            "linear_fc2",
        ):
            for which in "AB":
                lp = lora_param(param, which, RANK)
                factors[lp.name] = torch.randn(lp.shape, generator=gen) * 0.1
    write_lora_checkpoint(path, shape, layout, factors, RANK, ALPHA)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora")
    hf = root / "hf"
    save_tiny_checkpoint("qwen25", hf)
    shape = bridge_for_family("qwen25").shape_from_hf(AutoConfig.from_pretrained(hf).to_dict())
    _convert(load_dir=hf, save_dir=root / "mg", target_tensor_parallel_size=2, target_pipeline_parallel_size=2)
    _lora(shape, root / "lora", ParallelLayout(tp=2, pp=2))
    return {"hf": hf, "mg": root / "mg", "lora": root / "lora", "root": root}


def test_merge_equals_peft(setup) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = setup["root"]
    _convert(
        load_model_type="mg",
        save_model_type="hf",
        load_dir=setup["mg"],
        save_dir=root / "merged",
        lora_load=setup["lora"],
    )
    _convert(
        load_model_type="mg",
        save_model_type="hf",
        load_dir=setup["mg"],
        save_dir=root / "adapter",
        lora_load=setup["lora"],
        save_lora_to_hf=True,
    )
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))

    def load(path: str) -> AutoModelForCausalLM:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()

    with torch.no_grad():
        base = load(setup["hf"])(tokens).logits
        merged = load(root / "merged")(tokens).logits
        peft_model = PeftModel.from_pretrained(load(setup["hf"]), root / "adapter").eval()
        with_adapter = peft_model(tokens).logits
        peft_merged = peft_model.merge_and_unload()(tokens).logits
    assert (merged - base).abs().max() > 1e-2, "the adapter must change the model"
    assert (merged - with_adapter).abs().max() < 1e-5
    assert (merged - peft_merged).abs().max() < 1e-5


def test_merging_from_hf_equals_merging_from_megatron(setup) -> None:
    root = setup["root"]
    _convert(
        load_model_type="mg", save_model_type="hf", load_dir=setup["mg"], save_dir=root / "m1", lora_load=setup["lora"]
    )
    _convert(load_dir=setup["hf"], save_dir=root / "mg-merged", lora_load=setup["lora"], target_tensor_parallel_size=2)
    _convert(load_model_type="mg", save_model_type="hf", load_dir=root / "mg-merged", save_dir=root / "m2")
    first, second = load_file(next((root / "m1").glob("*.safetensors"))), {}
    for path in (root / "m1").glob("*.safetensors"):
        first.update(load_file(path))
    for path in (root / "m2").glob("*.safetensors"):
        second.update(load_file(path))
    assert sorted(first) == sorted(second)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_merge_keeps_bf16(tmp_path) -> None:
    from transformers import AutoConfig

    save_tiny_checkpoint("llama2", tmp_path / "hf", dtype=torch.bfloat16)
    shape = bridge_for_family("llama2").shape_from_hf(AutoConfig.from_pretrained(tmp_path / "hf").to_dict())
    _lora(shape, tmp_path / "lora", ParallelLayout())
    _convert(load_dir=tmp_path / "hf", save_dir=tmp_path / "mg", lora_load=tmp_path / "lora")
    _convert(load_model_type="mg", save_model_type="hf", load_dir=tmp_path / "mg", save_dir=tmp_path / "out")
    base, merged = {}, {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        base.update(load_file(path))
    for path in (tmp_path / "out").glob("*.safetensors"):
        merged.update(load_file(path))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    name = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(merged[name], base[name])
    assert torch.equal(merged["model.layers.1.input_layernorm.weight"], base["model.layers.1.input_layernorm.weight"])


def test_lora_errors_are_clear(setup, tmp_path) -> None:
    with pytest.raises(ValueError, match="--save-lora-to-hf exports the weights of --lora-load"):
        _convert(
            load_model_type="mg",
            save_model_type="hf",
            load_dir=setup["mg"],
            save_dir=tmp_path / "x",
            save_lora_to_hf=True,
        )
    with pytest.raises(ValueError, match="is not a Megatron checkpoint"):
        _convert(
            load_model_type="mg",
            save_model_type="hf",
            load_dir=setup["mg"],
            save_dir=tmp_path / "y",
            lora_load=setup["hf"],
        )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
