"""Qwen-Image text-to-image: diffusers' ``QwenImageTransformer2DModel`` (MMDiT with a Qwen2.5-VL text encoder).

Latents ``[B, C, H, W]`` (``AutoencoderKLQwenImage``'s one-frame latents without their frame axis,
normalised per channel with its ``latents_mean`` / ``latents_std``) are packed into 2x2 patches as
``QwenImagePipeline`` packs them (``[B, H/2 x W/2, 4C]``, the same arithmetic as FLUX's), with
``img_shapes`` ``(1, H/2, W/2)`` per sample for the model's 3-D rotary table; the timestep is the
sigma itself (the pipeline passes ``t / 1000``, the model scales it by 1000).

The text is ``QwenImagePipeline.encode_prompt``'s: Qwen2.5-VL's last hidden state of the prompt in
the pipeline's template, its first ``prompt_template_encode_start_idx`` (34) tokens dropped, of
variable length. The cache keeps each caption's real tokens; the trainer and the sampler zero-pad
them to ``data.text_len``. :func:`_inputs` cuts a batch back to its longest real text and gives the
model ``encoder_hidden_states_mask`` over the real tokens (padding rows are the all-zero rows: a
Qwen2.5-VL hidden state after its final RMSNorm is never all zero), None when every token is real,
which is what the pipeline passes for the same prompts. Guidance is the pipeline's ``true_cfg_scale``
with its norm rescale (:func:`_combine_guidance`). Every block is an FSDP2 unit. Under
sequence parallelism the joint text + image sequence is split (the plan of diffusers' ``_cp_plan``)
and the text mask's keys are gathered with the keys (under ring attention and USP they travel with the keys
as a bias channel: :func:`~mindspeed_mm.models.dit_parallel._key_bias_channels`).
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_mm.models.dit import DiTFamily, register_dit
from mindspeed_mm.models.dit_parallel import SequencePlan, Split
from mindspeed_mm.models.flux import pack_latents, unpack_latents

#: ``QwenImagePipeline``'s default ``max_sequence_length`` (the text tokens after the template's are dropped).
TEXT_LEN = 512


def text_mask(text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(text cut to the batch's longest real text, its mask or None when every token is real)``.

    Real tokens are the rows that are not all zero (the trainer and the sampler pad with zero rows).
    """
    real = text.ne(0).any(dim=-1)
    length = int(real.any(dim=0).nonzero().max()) + 1 if bool(real.any()) else text.shape[1]
    text, real = text[:, :length], real[:, :length]
    return text, None if bool(real.all()) else real.long()


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
) -> dict[str, Any]:
    b, _, height, width = noisy.shape
    text, mask = text_mask(text)
    inputs = {
        "hidden_states": pack_latents(noisy),
        "encoder_hidden_states": text,
        "encoder_hidden_states_mask": mask,
        "timestep": sigmas,
        "img_shapes": [[(1, height // 2, width // 2)]] * b,
        "return_dict": False,
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.full_like(sigmas, guidance)
    return inputs


def _combine_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """``QwenImagePipeline``'s true CFG: ``uncond + s (cond - uncond)`` rescaled to the conditional prediction's
    norm over each packed token's channels (the norms taken in the pipeline's packed layout)."""
    height, width = cond.shape[-2:]
    cond_packed, uncond_packed = pack_latents(cond), pack_latents(uncond)
    combined = uncond_packed + scale * (cond_packed - uncond_packed)
    cond_norm = torch.norm(cond_packed, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return unpack_latents(combined * (cond_norm / combined_norm), height, width)


def _timestep_kwargs(config: Any, steps: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """``QwenImagePipeline``'s sigmas ``linspace(1, 1/N, N)`` (none for flow-sigma schedulers) and ``mu`` of the
    packed image tokens (passed whether or not the scheduler shifts dynamically, as the pipeline does)."""
    import numpy as np
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    mu = calculate_shift(
        (shape[-2] // 2) * (shape[-1] // 2),
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
    return {"sigmas": sigmas, "mu": mu}


def _rotary_tables(model: Any) -> None:
    """The rotary embedding's frequency tables (plain attributes, not buffers) computed on the CPU again."""
    for module in model.modules():
        if isinstance(getattr(module, "pos_freqs", None), torch.Tensor) and module.pos_freqs.is_meta:
            with torch.device("cpu"):
                fresh = type(module)(module.theta, module.axes_dim, module.scale_rope)
            module.pos_freqs, module.neg_freqs = fresh.pos_freqs, fresh.neg_freqs


def _encode(parts: dict[str, Any], captions: list[str], text_len: int) -> tuple[torch.Tensor, None]:
    """``QwenImagePipeline.encode_prompt``'s text, zero-padded to ``text_len`` tokens ``[B, text_len, D]``."""
    from mindspeed_mm.models.encoders import encode_qwen_image

    rows = encode_qwen_image(parts["tokenizer"], parts["text_encoder"], captions, text_len)
    width = rows[0]["text"].shape[-1]
    return torch.stack(
        [torch.cat([r["text"], r["text"].new_zeros(text_len - len(r["text"]), width)]) for r in rows]
    ), None


def _select_variant(values: dict[str, Any]) -> str:
    """``edit`` in a ``QwenImageEditPipeline`` directory (its model_index.json), else the text-to-image family."""
    return "edit" if (values.get("_pipeline") or {}).get("_class_name") == "QwenImageEditPipeline" else ""


QWEN_IMAGE = register_dit(
    DiTFamily(
        architecture="QwenImageTransformer2DModel",
        model_class="diffusers:QwenImageTransformer2DModel",
        fsdp_plan=("transformer_blocks.{*}",),
        latent_dims=3,
        model_inputs=_inputs,
        prediction=lambda output, shape: unpack_latents(output[0], shape[-2], shape[-1]),
        tokens=lambda config, shape: (shape[1] // 2) * (shape[2] // 2),
        # diffusers' test configuration of the class (tests/pipelines/qwenimage/test_qwenimage.py) with the
        # tiny Qwen2.5-VL's width (64) as the text width and 4 heads.
        tiny_config={
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 64,
            "guidance_embeds": False,
            "axes_dims_rope": (8, 4, 4),
        },
        text_len=TEXT_LEN,
        fp32_inputs=("timestep", "guidance"),
        timestep_divisor=1000.0,
        # Qwen/Qwen-Image's scheduler_config.json.
        scheduler=(
            "FlowMatchEulerDiscreteScheduler",
            {
                "num_train_timesteps": 1000,
                "shift": 1.0,
                "use_dynamic_shifting": True,
                "base_shift": 0.5,
                "max_shift": 0.9,
                "base_image_seq_len": 256,
                "max_image_seq_len": 8192,
                "shift_terminal": 0.02,
                "time_shift_type": "exponential",
            },
        ),
        timestep_kwargs=_timestep_kwargs,
        encode_prompts=_encode,
        combine_guidance=_combine_guidance,
        materialize_tables=_rotary_tables,
        # diffusers' own _cp_plan of the class: the image and text tokens are split at the first block, the text
        # mask at every block, the rotary tables (image and text) as they leave pos_embed; every block attends
        # over both streams' shards (the masked text keys gathered with them); the image tokens are gathered
        # after proj_out.
        sequence_plan=SequencePlan(
            splits=(
                Split("transformer_blocks.0", "hidden_states", 1, "image"),
                Split("transformer_blocks.0", "encoder_hidden_states", 1, "text"),
                Split("transformer_blocks.{*}", "encoder_hidden_states_mask", 1),
                Split("pos_embed", None, 0),
            ),
            gather=("proj_out", 1, "image"),
            cross_attention_local=False,
        ),
        # both streams' attention projections, as for FLUX and SD3 (DiffSynth-Studio's Qwen-Image LoRA
        # recipes add the MLPs and modulations: name them in lora.target_modules)
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        latent_channels=lambda config: config["in_channels"] // 4,
        select_variant=_select_variant,
    )
)
