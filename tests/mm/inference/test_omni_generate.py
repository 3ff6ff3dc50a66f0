"""``mindspeed-mm generate`` on Qwen2.5-Omni audio prompts equals transformers' own ``generate``.

The reference builds its inputs with ``Qwen2_5OmniProcessor`` (the chat template's text, the clips
decoded at the feature extractor's rate, the image) and runs the thinker's ``generate`` greedily;
the CLI (``--prompt`` with ``--audio``, and a prompts file with audio and image + audio prompts; batches of
2) gives
the same prompt tokens and the same new tokens.
"""

from __future__ import annotations

import json

import torch

from mindspeed_mm.cli import main
from mindspeed_mm.data.audio import decode_audio
from mindspeed_mm.testing import write_tiny_audio_dataset, write_tiny_model

NEW_TOKENS = 8


def test_omni_greedy_equals_transformers_generate(tmp_path) -> None:
    from PIL import Image
    from transformers import (
        AutoTokenizer,
        Qwen2_5OmniProcessor,
        Qwen2_5OmniThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from mindspeed_mm.models.qwen2_5_omni import TOKEN_ATTRIBUTES

    model_dir = write_tiny_model(tmp_path / "omni", "Qwen2_5OmniThinkerForConditionalGeneration")
    data = write_tiny_audio_dataset(tmp_path / "data", num_samples=3)  # audio, audio, image + audio
    records = [json.loads(line) for line in data.read_text().splitlines()]
    prompts = data  # the answers become the references
    out = tmp_path / "out.jsonl"
    clip = str(data.parent / records[0]["audios"][0])
    argv = ["generate", "--load-dir", str(model_dir), "--prompt", "Which pitch is this?", "--audio", clip]
    argv += ["--prompts-file", str(prompts)]
    argv += ["--max-new-tokens", str(NEW_TOKENS), "--output", str(out), "--batch-size", "2"]
    argv += ["--image-min-pixels", "784", "--image-max-pixels", "12544"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name, token in TOKEN_ATTRIBUTES.items():
        setattr(tokenizer, name, token)
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir, min_pixels=784, max_pixels=12544),
        video_processor=Qwen2VLVideoProcessor.from_pretrained(model_dir),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir / "audio_processor"),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    placeholders = {
        "<audio>": "<|audio_bos|><|AUDIO|><|audio_eos|>",
        "<image>": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    }
    flag = {"messages": [{"role": "user", "content": "<audio>Which pitch is this?"}], "audios": records[0]["audios"]}
    assert len(rows) == len(records) + 1 == 4 and rows[0]["reference"] is None
    for row, record in zip(rows, [flag, *records], strict=True):
        content = record["messages"][0]["content"]
        for placeholder, text in placeholders.items():
            content = content.replace(placeholder, text)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(
            text=[text],
            audio=[decode_audio(str(data.parent / a), 16000, "ref") for a in record["audios"]],
            images=[Image.open(data.parent / i).convert("RGB") for i in record.get("images", [])] or None,
            return_tensors="pt",
        )
        with torch.no_grad():
            new = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, inputs["input_ids"].shape[1] :
            ]
        assert row["prompt_token_ids"] == inputs["input_ids"][0].tolist()
        assert row["token_ids"] == new.tolist() and len(new) > 0
        if len(record["messages"]) > 1:
            assert row["reference"] == record["messages"][-1]["content"]
    print(f"Omni generate: {[len(r['prompt_token_ids']) for r in rows]} prompt tokens, the same new tokens")
