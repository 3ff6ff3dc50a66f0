"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, dense): a ViT with learned positions and DeepStack mergers, a Qwen3 LLM with interleaved M-RoPE.

The tokens, chat template and position rule are Qwen2.5-VL's (transformers' ``get_rope_index``,
which raises without ``mm_token_type_ids``); the vision tower's intermediate features are
added to the first language layers at the image positions (DeepStack).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.family import VLMFamily, register_family
from mindspeed_mm.models.qwen2_5_vl import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    dummy_video_inputs,
    dummy_vision_inputs,
    image_inputs,
    pixel_bounds,
    rope_positions,
)
from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer


def frame_times(indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its frames (``Qwen3VLProcessor._calculate_timestamps``)."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [index / fps for index in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_inputs(out: Any, video_processor: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Patches and grids; per temporal patch ``<t seconds>`` then its tokens between vision start and end
    (``Qwen3VLProcessor.replace_video_token``)."""
    merge = int(getattr(video_processor, "merge_size", 1))
    grid = out["video_grid_thw"]
    texts = []
    for thw, metadata in zip(grid, out["video_metadata"]):
        per_frame = int(thw[1:].prod()) // merge**2
        times = frame_times(metadata.frames_indices, metadata.fps or 24, video_processor.temporal_patch_size)
        texts.append(
            "".join(
                f"<{times[t]:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_frame + "<|vision_end|>"
                for t in range(int(thw[0]))
            )
        )
    return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grid}, texts


def write_tiny(directory: Path, seed: int = 0) -> None:
    """A tiny Qwen3-VL (about 0.2 M parameters) with a byte tokenizer and small image and video processors."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
                "rope_theta": 10000.0,
            },
            "initializer_range": 0.1,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
            "initializer_range": 0.1,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        min_pixels=32 * 32,
        max_pixels=128 * 128,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(directory)
    Qwen3VLVideoProcessor(
        size={"shortest_edge": 32 * 32, "longest_edge": 16 * 128 * 128},
        patch_size=16,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_sample_frames=False,
        cap_pixels_per_frame=False,
    ).save_pretrained(directory)


QWEN3_VL = register_family(
    VLMFamily(
        architecture="Qwen3VLForConditionalGeneration",
        model_class="transformers:Qwen3VLForConditionalGeneration",
        encoders={"image": ("model.visual",), "video": ("model.visual",)},
        parts={
            "vision_tower": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
            "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
            "language_model": ("model.language_model", "lm_head"),
        },
        fsdp_plan=("model.visual.blocks.{*}", "model.visual", "model.language_model.layers.{*}"),
        image_placeholder="<|vision_start|><|image_pad|><|vision_end|>",
        image_token="<|image_pad|>",
        image_inputs=image_inputs,
        positions=rope_positions,
        write_tiny=write_tiny,
        language_module="model.language_model",
        dummy_vision_inputs=dummy_vision_inputs,
        vision_module="model.visual",
        processor_overrides=pixel_bounds,
        video_placeholder="<|vision_start|><|video_pad|><|vision_end|>",
        video_token="<|video_pad|>",
        video_inputs=video_inputs,
        dummy_video_inputs=dummy_video_inputs,
    )
)
