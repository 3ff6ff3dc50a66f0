"""Proof of every family's ``trains`` capability: the model the trainer builds from a Hugging Face
directory (``checkpoint.load_hf``: the family's shape, the one ``TransformerConfig`` builder, the
weights cut for this rank) computes transformers' logits, at TP2 (EP2 for MoE families).

All families run in one spawned group of 2 gloo ranks (the ranks never import transformers:
the reference logits come from the parent).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from mindspeed_llm.bridges import bridge_for_family, families_with

WORLD_SIZE = 2


def _rank(
    rank: int, world_size: int, sources: dict[str, str], tokens: torch.Tensor, reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed.megatron import adapt, unadapt
    from mindspeed_llm.testing.megatron_logits import megatron_logits
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.data import read_tokenizer
    from mindspeed_llm.training.hf import apply_load_hf, load_hf_weights, model_shape
    from mindspeed_llm.training.model import build_model, padded_vocab_size, recipe_transformer_config

    adapt("cpu")
    out: dict[str, float] = {}
    try:
        for family, path in sources.items():
            moe = bridge_for_family(family).capabilities.moe
            layout = ["parallel.ep=2", "model.moe_token_dispatcher_type=allgather"] if moe else ["parallel.tp=2"]
            config = apply_load_hf(
                load_pretrain_config(
                    None, [f"checkpoint.load_hf={path}", "data.seq_length=16", "data.mock=true", *layout]
                )
            )
            ids = read_tokenizer(config)
            vocab = padded_vocab_size(ids.vocab_size, config.model.make_vocab_size_divisible_by, config.parallel.tp)
            p = config.parallel
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tp, expert_model_parallel_size=p.ep, create_gloo_process_groups=False
            )
            model_parallel_cuda_manual_seed(1234)
            try:
                shape = model_shape(config, ids.vocab_size)
                transformer = recipe_transformer_config(config, shape, {"perform_initialization": False})
                chunks = build_model(shape, p, transformer, vocab, trainable=False, bridged=True)
                load_hf_weights(chunks, path, p, vocab)
                logits = megatron_logits(chunks, tokens)
                want = reference[family]
                out[family] = (logits[..., : want.shape[-1]] - want).abs().max().item()
            finally:
                ps.destroy_model_parallel()
    finally:
        unadapt()
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_every_trainable_family_builds_transformers_logits(tiny_checkpoints) -> None:
    from transformers import AutoModelForCausalLM

    families = families_with("trains")
    tokens = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = {}
    for family in families:
        model = AutoModelForCausalLM.from_pretrained(
            tiny_checkpoints[family], dtype=torch.float32, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            reference[family] = model(tokens).logits
    sources = {family: str(tiny_checkpoints[family]) for family in families}
    per_rank = run_distributed(_rank, WORLD_SIZE, sources, tokens, reference, timeout=600)
    diffs = {family: max(result[family] for result in per_rank) for family in families}
    bad = {family: diff for family, diff in diffs.items() if not diff < 1e-5}
    assert not bad, f"the trainer's model differs from transformers: {bad} (all: {diffs})"
