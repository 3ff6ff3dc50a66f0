"""Megatron checkpoints (per-rank at TP2 PP2, EP2 for MoE and DeepSeek-V3; megatron-core dist) generate what the
Hugging Face directory they were converted from generates, with nothing written by the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.inference import InferenceEngine, SamplingParams
from tests.llm.inference.conftest import random_prompts


def convert(source: Path, target: Path, **options) -> Path:
    convert_checkpoint(
        ConvertConfig(
            load_model_type="hf", save_model_type="mg", load_dir=source, save_dir=target, progress=False, **options
        )
    )
    return target


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("qwen25", {"target_tensor_parallel_size": 2, "target_pipeline_parallel_size": 2}),
        (
            "qwen3-moe",
            {"target_tensor_parallel_size": 2, "target_pipeline_parallel_size": 2, "target_expert_parallel_size": 2},
        ),
        ("llama2", {"target_tensor_parallel_size": 2, "ckpt_format": "torch_dist"}),
        (
            "deepseek3",
            {"target_tensor_parallel_size": 2, "target_pipeline_parallel_size": 2, "target_expert_parallel_size": 2},
        ),
    ],
)
def test_megatron_checkpoint_generates_like_the_hf_directory(
    engine, tiny_checkpoints, tmp_path, family: str, options: dict
) -> None:
    mg = convert(tiny_checkpoints[family], tmp_path / "mg", **options)
    before = files(mg)
    loaded = InferenceEngine.from_pretrained(mg, max_batch_size=2)
    assert files(mg) == before  # read in memory, nothing written
    prompts = random_prompts((6, 3, 9), seed=30)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = engine(family, max_batch_size=2).generate(prompts, params)
    assert [o.token_ids for o in loaded.generate(prompts, params)] == [o.token_ids for o in want]
    torch.testing.assert_close(
        loaded.forward_logits(prompts[2]), engine(family).forward_logits(prompts[2]), atol=0, rtol=0
    )
    assert loaded.tokenizer is not None and loaded.eos_token_ids == engine(family).eos_token_ids  # from hf_config


def test_megatron_checkpoint_without_hf_config_takes_hf_cfg_dir(engine, tiny_checkpoints, tmp_path) -> None:
    mg = convert(tiny_checkpoints["qwen3"], tmp_path / "mg", target_pipeline_parallel_size=2)
    shutil.rmtree(mg / "hf_config")
    bare = InferenceEngine.from_pretrained(mg)  # the model from the args alone, no tokenizer
    assert bare.tokenizer is None
    tokens = random_prompts((7,), seed=31)[0]
    torch.testing.assert_close(bare.forward_logits(tokens), engine("qwen3").forward_logits(tokens), atol=0, rtol=0)
    with_cfg = InferenceEngine.from_pretrained(mg, hf_cfg_dir=tiny_checkpoints["qwen3"])
    assert with_cfg.tokenizer is not None


def test_not_a_checkpoint_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        InferenceEngine.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="neither a Hugging Face directory .* nor a Megatron checkpoint"):
        InferenceEngine.from_pretrained(tmp_path)
    # A megatron-core dist checkpoint whose common state has no args (another trainer's, or an old one).
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000005" / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    torch.save({"config": {}}, tmp_path / "iter_0000005" / "common.pt")
    # A real DCP .metadata (checked before megatron reads the directory: docs/reliability.md, Trust).
    dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(tmp_path / "iter_0000005"), no_dist=True)
    with pytest.raises(ValueError, match="records no model args.*checkpoint.save_hf"):
        InferenceEngine.from_pretrained(tmp_path)
