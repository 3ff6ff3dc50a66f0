"""FLUX.1 text-to-image: diffusers' ``FluxTransformer2DModel``.

Latents ``[B, C, H, W]`` are packed into 2x2 patches (``[B, H/2 x W/2, 4C]``, as ``FluxPipeline``
packs them) with their image ids; the timestep is the sigma itself (the model scales it by
1000); the T5 text embeddings come with zero text ids, the CLIP pooled embedding as
``pooled_projections``; a guidance-distilled model (``guidance_embeds``, FLUX.1-dev) is given
``diffusion.guidance_scale``. FSDP2 wraps each double- and single-stream block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mindspeed_mm.models.dit import DiTFamily, register_dit
from mindspeed_mm.models.dit_parallel import SequencePlan, Split


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, H/2 x W/2, 4C]``: 2x2 patches, channels fastest-inner (``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_latents` for latents of ``height x width``."""
    b, _, channels = packed.shape
    return (
        packed.view(b, height // 2, width // 2, channels // 4, 2, 2)
        .permute(0, 3, 1, 4, 2, 5)
        .reshape(b, channels // 4, height, width)
    )


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[H/2 x W/2, 3]`` positions of the packed patches: ``(0, row, column)``."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
) -> dict[str, Any]:
    _, _, height, width = noisy.shape
    inputs = {
        "hidden_states": pack_latents(noisy),
        "encoder_hidden_states": text,
        "pooled_projections": pooled,
        "timestep": sigmas,
        "img_ids": image_ids(height, width, noisy.device, noisy.dtype),
        "txt_ids": torch.zeros(text.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
        "return_dict": False,
    }
    inputs["guidance"] = torch.full_like(sigmas, guidance) if config.guidance_embeds else None
    return inputs


def _timestep_kwargs(config: Any, steps: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """``FluxPipeline``'s sigmas (``linspace(1, 1/N, N)``, none for flow-sigma schedulers) and ``mu`` of the image size."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu = calculate_shift(
        (shape[-2] // 2) * (shape[-1] // 2),
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
    return {"sigmas": sigmas, "mu": mu}


def _encode(parts: dict[str, Any], captions: list[str], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T5's output over ``text_len`` tokens and CLIP's pooled output (``FluxPipeline.encode_prompt``)."""
    from mindspeed_mm.models.encoders import encode_t5_clip  # here: it loads diffusers' Wan pipeline module

    rows = encode_t5_clip(
        parts["tokenizer"], parts["text_encoder"], parts["tokenizer_2"], parts["text_encoder_2"], captions, text_len
    )
    return torch.stack([r["text"] for r in rows]), torch.stack([r["pooled"] for r in rows])


FLUX = register_dit(
    DiTFamily(
        architecture="FluxTransformer2DModel",
        model_class="diffusers:FluxTransformer2DModel",
        fsdp_plan=("transformer_blocks.{*}", "single_transformer_blocks.{*}"),
        latent_dims=3,
        model_inputs=_inputs,
        prediction=lambda output, shape: unpack_latents(output[0], shape[-2], shape[-1]),
        tokens=lambda config, shape: (shape[1] // 2) * (shape[2] // 2),
        tiny_config={
            "patch_size": 1,
            "in_channels": 16,
            "out_channels": None,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "guidance_embeds": True,
            "axes_dims_rope": (4, 4, 8),
        },
        needs_pooled=True,
        fp32_inputs=("timestep", "guidance"),
        timestep_divisor=1000.0,
        # FLUX.1's scheduler_config.json.
        scheduler=(
            "FlowMatchEulerDiscreteScheduler",
            {
                "num_train_timesteps": 1000,
                "shift": 3.0,
                "use_dynamic_shifting": True,
                "base_shift": 0.5,
                "max_shift": 1.15,
                "base_image_seq_len": 256,
                "max_image_seq_len": 4096,
            },
        ),
        timestep_kwargs=_timestep_kwargs,
        encode_prompts=_encode,
        # The joint attention's text and image tokens are both split at the model's input (with their
        # position ids); the image tokens are gathered after proj_out (diffusers' own _cp_plan of the class).
        sequence_plan=SequencePlan(
            splits=(
                Split("", "encoder_hidden_states", 1, "text"),
                Split("", "hidden_states", 1, "image"),
                Split("", "txt_ids", 0),
                Split("", "img_ids", 0),
            ),
            gather=("proj_out", 1, "image"),
            cross_attention_local=False,
        ),
        # train_dreambooth_lora_flux.py's attention targets: both streams' projections (the single
        # blocks have no to_out: their attention output goes through proj_out with the MLP's)
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        latent_channels=lambda config: config["in_channels"] // 4,
    )
)
