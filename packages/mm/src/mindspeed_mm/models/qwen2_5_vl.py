"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a window-attention ViT, a 2x2 patch merger, a Qwen2 LLM with M-RoPE.

Positions: every text token advances one position on all three rotary axes; an image's tokens
take (temporal, height, width) grid positions (transformers' ``get_rope_index``, which needs
``mm_token_type_ids``: without them transformers silently falls back to 1-D positions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.family import VLMFamily, register_family
from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer

#: The Qwen2-VL chat template for string contents (placeholders already in the text).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def image_inputs(out: Any, image_processor: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Patches and grids; one image token per merged patch (``t * h * w / merge^2``)."""
    merge = int(getattr(image_processor, "merge_size", 1))
    grid = out["image_grid_thw"]
    return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, [int(g.prod()) // merge**2 for g in grid]


def video_inputs_for(token: str, seconds_key: str) -> Any:
    """The family's ``video_inputs``: patches, grids and the seconds per temporal grid step under
    ``seconds_key`` (``temporal_patch_size / sampled fps``, as the Qwen processors compute it); one
    ``token`` per merged patch."""

    def video_inputs(out: Any, video_processor: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
        merge = int(getattr(video_processor, "merge_size", 1))
        grid = out["video_grid_thw"]
        seconds = [video_processor.temporal_patch_size / m.sampled_fps for m in out["video_metadata"]]
        vision = {
            "pixel_values_videos": out["pixel_values_videos"],
            "video_grid_thw": grid,
            seconds_key: torch.tensor(seconds, dtype=torch.float32),
        }
        return vision, [token * (int(g.prod()) // merge**2) for g in grid]

    return video_inputs


#: ``Qwen2_5_VLProcessor``'s rule: ``second_per_grid_ts``, one ``<|video_pad|>`` per merged patch.
video_inputs = video_inputs_for("<|video_pad|>", "second_per_grid_ts")


def dummy_video_inputs(config: Any) -> dict[str, torch.Tensor]:
    """One merged patch of one temporal patch (the vision tower's smallest video input)."""
    inputs = dummy_vision_inputs(config)
    return {"pixel_values_videos": inputs["pixel_values"], "video_grid_thw": inputs["image_grid_thw"]}


def rope_positions(model: Any, sample: Any) -> torch.Tensor:
    """[4, 1, L]: the text positions, then the M-RoPE positions of transformers' own ``get_rope_index``
    (videos' temporal positions spaced by ``second_per_grid_ts`` for Qwen2.5-VL)."""
    ids = sample.input_ids[None]
    vision = sample.vision
    extra = {"second_per_grid_ts": vision["second_per_grid_ts"]} if "second_per_grid_ts" in vision else {}
    rope, _ = model.model.get_rope_index(
        ids,
        sample.mm_token_type_ids[None],
        image_grid_thw=vision.get("image_grid_thw"),
        video_grid_thw=vision.get("video_grid_thw"),
        **extra,
    )
    text = torch.arange(ids.shape[1], dtype=rope.dtype).view(1, 1, -1)
    return torch.cat([text, rope.to("cpu")], dim=0)


def dummy_vision_inputs(config: Any) -> dict[str, torch.Tensor]:
    """One merged patch: a 2 x 2 grid of zero patches (the vision tower's smallest input)."""
    vision = config.vision_config
    channels = getattr(vision, "in_chans", None) or vision.in_channels
    width = channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size
    return {"pixel_values": torch.zeros(merge * merge, width), "image_grid_thw": torch.tensor([[1, merge, merge]])}


def pixel_bounds(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    """Images are resized so their pixel count lies within the bounds."""
    return {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}


def write_tiny(directory: Path, seed: int = 0) -> None:
    """A tiny Qwen2.5-VL (about 0.2 M parameters) with a byte tokenizer and small image and video processors."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            "tie_word_embeddings": False,
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
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
            "initializer_range": 0.1,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(directory)
    Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=112 * 112, cap_pixels_per_frame=False).save_pretrained(
        directory
    )


QWEN2_5_VL = register_family(
    VLMFamily(
        architecture="Qwen2_5_VLForConditionalGeneration",
        model_class="transformers:Qwen2_5_VLForConditionalGeneration",
        encoders={"image": ("model.visual",), "video": ("model.visual",)},
        parts={
            "vision_tower": ("model.visual.patch_embed", "model.visual.blocks"),
            "projector": ("model.visual.merger",),
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
