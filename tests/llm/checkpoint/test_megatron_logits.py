"""Proof (b): converted checkpoints give the transformers model's logits in megatron-core.

Every family's tiny checkpoint is converted to its target layout (TP2 PP2 for dense families,
also PP2 x VPP for Llama, TP2 EP2 for MoE families), then loaded strictly into megatron-core ``GPTModel`` s built with
``mindspeed.megatron.spec.get_gpt_layer_spec`` (reference kernels) on 4 real gloo ranks, one
rank file each. Megatron's own pipeline schedule computes the logits, which must equal the
transformers model's to 1e-5 (fp32) on the same tokens.

DeepSeek-V3 and GLM-4.5 with their multi-token-prediction layers (``--mtp-num-layers``) at TP2 PP2: megatron's
``GPTModel`` with the MTP block on the last stage (and the embedding copy it needs there) loads
the rank files strictly; the logits compared are the main model's (megatron runs the MTP block
only to compute a training loss from labels).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from mindspeed_llm.bridges import bridge_for_family
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS

from .conftest import MTP_LAYERS

#: The sources of the MTP cases (the ``tiny_mtp_checkpoint`` and ``tiny_glm45_mtp_checkpoint``
#: fixtures), beside the families' tiny checkpoints.
MTP_SOURCE = "deepseek3+mtp"
GLM_MTP_SOURCE = "glm45-moe+mtp"


def _family_case(family: str) -> tuple[str, tuple[str, dict]]:
    # Every family at its default layout: TP2 PP2 for dense families, TP2 EP2 for MoE families.
    if bridge_for_family(family).capabilities.moe:
        return f"{family}-tp2ep2", (family, dict(target_tensor_parallel_size=2, target_expert_parallel_size=2))
    return f"{family}-tp2pp2", (family, dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2))


#: label -> (family, target layout options).
CASES = {
    **dict(_family_case(family) for family in TINY_CONFIGS),
    "llama2-pp2vpp": (
        "llama2",
        dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
    "deepseek3-mtp-tp2pp2": (
        MTP_SOURCE,
        dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2, mtp_num_layers=MTP_LAYERS),
    ),
    "glm45-moe-mtp-tp2pp2": (
        GLM_MTP_SOURCE,
        dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2, mtp_num_layers=MTP_LAYERS),
    ),
    # A dist checkpoint (written at TP1 by megatron-core itself) loaded at TP2 PP2 by megatron-core.
    "qwen25-torch_dist": (
        "qwen25",
        dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2, ckpt_format="torch_dist"),
    ),
    # GPT-OSS's sinks live in the registry attention (megatron's own allocates them on CUDA): its
    # sharded_state_dict must write and read them as megatron's softmax_offset.
    "gpt-oss-torch_dist": (
        "gpt-oss",
        dict(target_tensor_parallel_size=2, target_expert_parallel_size=2, ckpt_format="torch_dist"),
    ),
}
WORLD_SIZE = 4


def _rank_logits(
    rank: int, world_size: int, cases: list[tuple[str, str]], tokens: torch.Tensor, reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    # The transformers logits come from the parent: the ranks never import transformers (seconds each).
    from mindspeed.megatron import adapt, unadapt
    from mindspeed_llm.testing.megatron_logits import (
        checkpoint_model,
        destroy_layout,
        init_layout,
        load_rank_chunks,
        megatron_logits,
    )

    adapt("cpu")
    out = {}
    try:
        for label, mg_dir in cases:
            shape, layout, _ = checkpoint_model(mg_dir)
            init_layout(layout, shape)
            try:
                chunks = load_rank_chunks(mg_dir)
                if shape.mtp_num_layers:
                    # Loaded strictly with the MTP block; its forward needs labels (it only adds a loss),
                    # so the main model's logits are computed with it switched off.
                    assert any(getattr(chunk, "mtp_process", False) for chunk in chunks) == (
                        layout.pp - 1 == _pp_rank()
                    )
                    for chunk in chunks:
                        chunk.mtp_process = False
                        chunk.config.mtp_num_layers = None
                logits = megatron_logits(chunks, tokens)
            finally:
                destroy_layout()
            if logits is not None:
                want = reference[label]
                out[label] = (logits[..., : want.shape[-1]] - want).abs().max().item()
    finally:
        unadapt()
    return out


def _pp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank()


def _convert_all(sources: dict, root, tokens: torch.Tensor) -> tuple[list[tuple[str, str]], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    cases, reference = [], {}
    for label, (family, options) in CASES.items():
        save = root / label
        convert_checkpoint(ConvertConfig(load_dir=sources[family], save_dir=save, progress=False, **options))
        cases.append((label, str(save)))
        model = AutoModelForCausalLM.from_pretrained(sources[family], dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            reference[label] = model.eval()(tokens).logits
    return cases, reference


def test_every_family_is_checked() -> None:
    assert {family for family, _ in CASES.values()} == set(TINY_CONFIGS) | {MTP_SOURCE, GLM_MTP_SOURCE}


@pytest.mark.slow
@pytest.mark.distributed
def test_converted_logits_equal_transformers(
    tiny_checkpoints, tiny_mtp_checkpoint, tiny_glm45_mtp_checkpoint, tmp_path
) -> None:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    sources = {**tiny_checkpoints, MTP_SOURCE: tiny_mtp_checkpoint, GLM_MTP_SOURCE: tiny_glm45_mtp_checkpoint}
    cases, reference = _convert_all(sources, tmp_path, tokens)
    per_rank = run_distributed(_rank_logits, WORLD_SIZE, cases, tokens, reference, timeout=600)
    diffs = {}
    for result in per_rank:
        for label, diff in result.items():
            diffs[label] = max(diff, diffs.get(label, 0.0))
    assert sorted(diffs) == sorted(CASES), f"no last-stage result for {set(CASES) - set(diffs)}"
    bad = {label: diff for label, diff in diffs.items() if not diff < 1e-5}
    assert not bad, f"logits differ from transformers: {bad} (all: {diffs})"
