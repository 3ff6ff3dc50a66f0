"""Stable Diffusion 3 text-to-image: diffusers' ``SD3Transformer2DModel`` (MMDiT).

Latents ``[B, C, H, W]`` go in as they are (the model patchifies them itself, with its own
position embedding); the timestep is ``sigma x 1000`` (``StableDiffusion3Pipeline`` passes the
scheduler's ``t``); the text is ``StableDiffusion3Pipeline.encode_prompt``'s: the two CLIP
encoders' penultimate hidden states concatenated on features and zero-padded to T5's width,
followed on the sequence by T5's output over its ``max_sequence_length`` tokens; the pooled
embedding (``pooled_projections``) is the two CLIPs' projected outputs concatenated. The text
length (``data.text_len``) counts both: the CLIP tokenizer's ``model_max_length`` (77) plus T5's
tokens (default 256, the pipeline's ``max_sequence_length``). Every joint-attention block is an
FSDP2 unit.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_mm.models.dit import DiTFamily, register_dit
from mindspeed_mm.models.dit_parallel import SequencePlan, Split

#: The CLIP tokens of the pipeline's tokenizers (``tokenizer_max_length``) plus its default ``max_sequence_length``.
TEXT_LEN = 77 + 256


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
) -> dict[str, Any]:
    return {
        "hidden_states": noisy,
        "timestep": sigmas * 1000.0,
        "encoder_hidden_states": text,
        "pooled_projections": pooled,
        "return_dict": False,
    }


def _tokens(config: Any, shape: tuple[int, ...]) -> int:
    p = config.patch_size
    return (shape[1] // p) * (shape[2] // p)


def _timestep_kwargs(config: Any, steps: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """``mu`` of the image size when the scheduler shifts dynamically (SD3.5 variants), as the pipeline computes it.

    The pipeline counts latent pixels over the transformer's patch size; the sampler only knows the
    latents' shape, so this uses SD3's patch size 2 (every released SD3 / SD3.5 transformer's).
    """
    if not config.get("use_dynamic_shifting"):
        return {}
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    mu = calculate_shift(
        (shape[-2] // 2) * (shape[-1] // 2),
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.16),
    )
    return {"mu": mu}


def _encode(
    parts: dict[str, Any], captions: list[str], text_len: int, clip_skip: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``StableDiffusion3Pipeline.encode_prompt``'s text ``[B, text_len, D]`` and pooled ``[B, P]`` (and its
    ``clip_skip``)."""
    from mindspeed_mm.models.encoders import encode_sd3

    rows = encode_sd3(
        parts["tokenizer"],
        parts["text_encoder"],
        parts["tokenizer_2"],
        parts["text_encoder_2"],
        parts["tokenizer_3"],
        parts["text_encoder_3"],
        captions,
        text_len,
        clip_skip=clip_skip,
    )
    return torch.stack([r["text"] for r in rows]), torch.stack([r["pooled"] for r in rows])


SD3 = register_dit(
    DiTFamily(
        architecture="SD3Transformer2DModel",
        model_class="diffusers:SD3Transformer2DModel",
        fsdp_plan=("transformer_blocks.{*}",),
        latent_dims=3,
        model_inputs=_inputs,
        prediction=lambda output, shape: output[0],
        tokens=_tokens,
        # diffusers' test configuration of the class (tests/models/transformers/test_models_transformer_sd3.py)
        # with SD3's patch size 2 and a T5 width (48) that the two tiny CLIPs' 2 x 16 features pad into.
        tiny_config={
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_projection_dim": 32,
            "joint_attention_dim": 48,
            "pooled_projection_dim": 32,
            "out_channels": 4,
            "pos_embed_max_size": 16,
        },
        text_len=TEXT_LEN,
        needs_pooled=True,
        # stabilityai/stable-diffusion-3-medium-diffusers' scheduler_config.json.
        scheduler=("FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 1000, "shift": 3.0}),
        timestep_kwargs=_timestep_kwargs,
        encode_prompts=_encode,
        encode_options=("clip_skip",),
        # The joint attention's image tokens (after the patch and position embedding) and text tokens (after
        # the context projection) are both split; every block attends over both streams' shards; SD3.5's
        # dual-attention layers' second attention (attn2, called without the text) over the image shards
        # only; the image tokens are gathered after proj_out.
        sequence_plan=SequencePlan(
            splits=(Split("pos_embed", None, 1, "image"), Split("context_embedder", None, 1, "text")),
            gather=("proj_out", 1, "image"),
            cross_attention_local=False,
            self_attention=("image",),
        ),
        # train_dreambooth_lora_sd3.py's targets: both streams' attention projections
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        latent_channels=lambda config: config.get("out_channels") or config["in_channels"],
        skip_layers=lambda config: config.num_layers,
    )
)
