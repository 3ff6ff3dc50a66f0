"""Reference inputs and generations built with transformers alone (no mindspeed_mm code), for the generate and
evaluate tests: the chat template's text, the image token repeated by the family's rule (merged patches for
Qwen-VL, ``image_seq_length`` per tile for InternVL), the whole string tokenized at once, the model directory's
image processor, and transformers' own ``generate``; and the family's own transformers processor (``Qwen2_5_VLProcessor``,
``Qwen3VLProcessor``, ``InternVLProcessor``) with its call defaults (InternVL: tiles and a thumbnail)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

#: architecture -> the family's transformers processor class
PROCESSORS = {
    "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLProcessor",
    "Qwen3VLForConditionalGeneration": "Qwen3VLProcessor",
    "InternVLForConditionalGeneration": "InternVLProcessor",
}
NEW_TOKENS = 12
PIXELS = ["--image-min-pixels", "784", "--image-max-pixels", "12544"]  # the tiny processors' own bounds
#: architecture -> (text that stands for one image, the token the processor repeats)
PLACEHOLDERS = {
    "Qwen2_5_VLForConditionalGeneration": ("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>"),
    "Qwen3VLForConditionalGeneration": ("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>"),
    "InternVLForConditionalGeneration": ("<img><IMG_CONTEXT></img>", "<IMG_CONTEXT>"),
}


def reference_inputs(model_dir: Path, messages: list[dict], images: list[Path]) -> dict:
    """Model inputs built with transformers only (the family's token count rule written out here)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    placeholder, token = PLACEHOLDERS[config["architectures"][0]]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{**m, "content": m["content"].replace("<image>", placeholder)} for m in messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = {}
    if images:
        intern = config["architectures"][0].startswith("InternVL")
        out = AutoImageProcessor.from_pretrained(model_dir)(
            images=[Image.open(p).convert("RGB") for p in images],
            return_tensors="pt",
            **({"crop_to_patches": True} if intern else {}),  # InternVLProcessor's call default: tiles + thumbnail
        )
        if "image_grid_thw" in out:  # Qwen-VL: one token per 2 x 2 merged patch
            counts = [int(g.prod()) // 4 for g in out["image_grid_thw"]]
            inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        else:  # InternVL: image_seq_length tokens per tile
            counts = [config["image_seq_length"] * int(n) for n in out["num_patches"]]
            inputs.update(pixel_values=out["pixel_values"])
        pieces = text.split(token)
        text = pieces[0] + "".join(token * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    if "image_grid_thw" in inputs or not images and "Qwen" in config["architectures"][0]:
        inputs["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids(token)).int()
    return inputs


def transformers_generate(
    model_dir: Path, messages: list[dict], images: list[Path], max_new_tokens: int = NEW_TOKENS, **sampling
) -> tuple[list, list]:
    """(prompt ids, new ids) of transformers' own generate."""
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = reference_inputs(model_dir, messages, images)
    if sampling:
        torch.manual_seed(sampling.pop("seed"))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=bool(sampling), **sampling)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


def images_by_size(data: Path) -> list[Path]:
    """The dataset's images, largest first (several merged patches: M-RoPE positions differ from 1-D ones)."""

    def pixels(path: Path) -> int:
        with Image.open(path) as image:
            return image.size[0] * image.size[1]

    return sorted((data.parent / "images").glob("*.png"), key=lambda path: (-pixels(path), path.name))


def transformers_processor(processing):
    """The family's own transformers processor over the directory's tokenizer and processors, and the text an
    image is written as for it (InternVL's wraps the context token in <img></img> itself)."""
    import transformers

    family, tokenizer = processing.family, processing.tokenizer
    kwargs, image_text = {}, family.image_placeholder
    if family.architecture.startswith("InternVL"):
        tokenizer.start_image_token, tokenizer.end_image_token = "<img>", "</img>"
        tokenizer.context_image_token, tokenizer.video_token = "<IMG_CONTEXT>", "<video>"
        tokenizer.start_image_token_id, tokenizer.end_image_token_id, tokenizer.context_image_token_id = (
            tokenizer.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>")
        )
        kwargs, image_text = {"image_seq_length": 4}, "<IMG_CONTEXT>"
    processor = getattr(transformers, PROCESSORS[family.architecture])(
        image_processor=processing.image_processor,
        tokenizer=tokenizer,
        video_processor=processing.video_processor,
        chat_template=tokenizer.chat_template,
        **kwargs,
    )
    return processor, image_text


def processor_inputs(processing, sample, video_settings, generation: bool = False) -> dict:
    """The inputs the family's transformers processor builds for ``sample`` with its own call defaults (the
    same decoded frames and metadata; InternVL's images cut into tiles plus a thumbnail)."""
    from mindspeed_mm.data.video import decode_video

    processor, image_text = transformers_processor(processing)
    messages = [
        {
            "role": m["role"],
            "content": m["content"]
            .replace("<image>", image_text)
            .replace("<video>", processing.family.video_placeholder),
        }
        for m in sample.messages
    ]
    clips = [decode_video(video, video_settings, sample.source) for video in sample.videos]
    return processor(
        text=[processing.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)],
        images=[Image.open(path).convert("RGB") for path in sample.images] or None,
        videos=[clip.frames for clip in clips] or None,
        video_metadata=[clip.metadata() for clip in clips] or None,
        do_sample_frames=False,
        return_tensors="pt",
    )
