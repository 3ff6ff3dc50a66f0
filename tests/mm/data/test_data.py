"""mllm_format data: malformed samples named by file and line, labels only on answers, image tokens per patch."""

from __future__ import annotations

import json
import re

import pytest

from mindspeed_mm.data import encode_sample, read_mllm_files
from mindspeed_mm.data.encode import IGNORE_INDEX
from mindspeed_mm.models import family_of, load_processing


def _write(path, *records, raw: str = "") -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw)
    return str(path)


def test_malformed_samples_name_file_line_and_fix(tmp_path, tiny_vlm) -> None:
    _, data = tiny_vlm
    image = str(data.parent / "images" / "0000.png")
    good = {
        "messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Yo"}],
        "images": [image],
    }
    cases = [
        ({**good, "images": []}, "1 <image> placeholder(s) but 0 image(s); add the image paths"),
        ({**good, "images": [image, image]}, "1 <image> placeholder(s) but 2 image(s); add <image>"),
        (
            {**good, "images": ["missing.png"]},
            f"image 'missing.png' not found (looked for {tmp_path / 'missing.png'}); fix the path or set "
            "data.image_dir to the folder the paths are relative to",
        ),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
        ({"messages": [{"role": "bot", "content": "Hi"}]}, "messages[0] must be"),
    ]
    for record, message in cases:
        name = _write(tmp_path / "d.jsonl", good, record)
        with pytest.raises(ValueError, match=re.escape(f"d.jsonl:2: {message}")):
            read_mllm_files([name])
    name = _write(tmp_path / "d.jsonl", good, raw="{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON \(.*\); write one sample object per line"):
        read_mllm_files([name])
    name = tmp_path / "d.json"  # a .json file holds one list of samples
    name.write_text(json.dumps([good]) + ",\n{")
    with pytest.raises(
        ValueError, match=r"d.json:1: not valid JSON \(.*\); a .json data file holds one list of samples"
    ):
        read_mllm_files([str(name)])


def test_labels_only_on_answers_and_image_tokens_per_patch(tiny_vlm) -> None:
    model_dir, data = tiny_vlm
    family = family_of(model_dir)
    tokenizer, processor = load_processing(model_dir, 28 * 28, 112 * 112)
    sample = read_mllm_files([str(data)])[0]
    sample = type(sample)(
        messages=sample.messages + ({"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}),
        images=sample.images,
        source=sample.source,
    )
    encoded = encode_sample(sample, tokenizer, processor, family, cutoff_len=1024)
    image_id = tokenizer.convert_tokens_to_ids(family.image_token)
    merge = processor.merge_size
    assert int((encoded.input_ids == image_id).sum()) == int(encoded.vision["image_grid_thw"].prod()) // merge**2 > 0
    assert encoded.mm_token_type_ids.tolist() == (encoded.input_ids == image_id).int().tolist()
    learned = tokenizer.decode(encoded.input_ids[encoded.labels != IGNORE_INDEX])
    assert learned == "It is red.<|im_end|>\nYes.<|im_end|>\n"
    assert tokenizer.decode(encoded.input_ids).startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    last = encode_sample(sample, tokenizer, processor, family, cutoff_len=1024, mask_history=True)
    assert tokenizer.decode(last.input_ids[last.labels != IGNORE_INDEX]) == "Yes.<|im_end|>\n"
    everything = encode_sample(sample, tokenizer, processor, family, cutoff_len=1024, train_on_prompt=True)
    assert bool((everything.labels == everything.input_ids).all())
    with pytest.raises(ValueError, match="beyond data.cutoff_len=8; raise data.cutoff_len"):
        encode_sample(sample, tokenizer, processor, family, cutoff_len=8)
