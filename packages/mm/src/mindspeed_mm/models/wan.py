"""Wan2.1 / Wan2.2 text-to-video: diffusers' ``WanTransformer3DModel``.

(Its image-to-video configurations are the ``i2v`` variant, :mod:`mindspeed_mm.models.wan_i2v`.)

Latents ``[B, C, F, H, W]`` go in as they are; the timestep is ``sigma x 1000`` (the grid's
timestep, as ``WanPipeline`` passes it); the UMT5 text embeddings are zero-padded to 512 tokens
as ``WanPipeline`` pads them. FSDP2 wraps each block (MindSpeed-MM's Wan2.2 plan
``predictor.blocks.{*}``). Sequence parallelism splits the video tokens before the blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_mm.models.dit import DiTFamily, register_dit
from mindspeed_mm.models.dit_parallel import SequencePlan, Split


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
) -> dict[str, Any]:
    return {"hidden_states": noisy, "timestep": sigmas * 1000.0, "encoder_hidden_states": text, "return_dict": False}


def _encode(parts: dict[str, Any], captions: list[str], text_len: int) -> tuple[torch.Tensor, None]:
    """UMT5's output of each caption's real tokens, zero-padded to ``text_len`` (``WanPipeline.encode_prompt``)."""
    from mindspeed_mm.models.encoders import encode_umt5  # here: it loads diffusers' Wan pipeline module

    rows = encode_umt5(parts["tokenizer"], parts["text_encoder"], captions, text_len)
    return torch.stack([torch.cat([r, r.new_zeros(text_len - r.shape[0], r.shape[1])]) for r in rows]), None


def _variant(config: dict[str, Any]) -> str:
    """``i2v`` for an image-to-video transformer: its input holds the mask and the first-frame latents too
    (Wan2.1 / Wan2.2 I2V: 36 input channels, 16 output), ``flf2v`` for one that also takes the last frame
    (Wan2.1 FLF2V: ``pos_embed_seq_len`` for its two images' features); ``ti2v`` for one whose pipeline gives per-token
    timesteps (Wan2.2 TI2V-5B: ``expand_timesteps`` in ``model_index.json``, read into ``_pipeline``)."""
    out = config.get("out_channels") or config.get("in_channels")
    if config.get("in_channels", out) != out:  # FLF2V: two images' features, position-embedded
        return "flf2v" if config.get("pos_embed_seq_len") else "i2v"
    return "ti2v" if config.get("_pipeline", {}).get("expand_timesteps") else ""


def _tokens(config: Any, shape: tuple[int, ...]) -> int:
    p_t, p_h, p_w = config.patch_size
    return (shape[1] // p_t) * (shape[2] // p_h) * (shape[3] // p_w)


WAN = register_dit(
    DiTFamily(
        architecture="WanTransformer3DModel",
        model_class="diffusers:WanTransformer3DModel",
        fsdp_plan=("blocks.{*}",),
        latent_dims=4,
        model_inputs=_inputs,
        prediction=lambda output, shape: output[0],
        tokens=_tokens,
        # diffusers' own test configuration of the class (tests/models/transformers/test_models_transformer_wan.py)
        tiny_config={
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
        # The scheduler of Wan2.1's diffusers pipelines (and MindSpeed-MM's Wan inference recipes).
        scheduler=(
            "UniPCMultistepScheduler",
            {
                "prediction_type": "flow_prediction",
                "use_flow_sigmas": True,
                "flow_shift": 3.0,
                "num_train_timesteps": 1000,
                "solver_order": 2,
                "solver_type": "bh2",
                "final_sigmas_type": "zero",
            },
        ),
        encode_prompts=_encode,
        # Video tokens split after the patch embedding (with their rotary table), gathered after proj_out;
        # the text of the cross-attention is replicated (diffusers' own _cp_plan of the class splits there too).
        sequence_plan=SequencePlan(
            splits=(Split("rope", None, 1), Split("blocks.0", 0, 1, "video")),
            gather=("proj_out", 1, "video"),
            cross_attention_local=True,
        ),
        # self- and cross-attention of every block (attn1 / attn2), as diffusers' Wan LoRA trainers target
        lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
        select_variant=_variant,
    )
)
