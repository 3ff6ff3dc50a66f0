"""Videos in vision-language samples: decoding as LLaMA-Factory does, the same inputs as transformers' own
processors, errors naming the file, line and fix; cached, parallel preprocessing (bit-exact, invalidated)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
import transformers

from mindspeed_mm.data import read_mllm_files
from mindspeed_mm.data.preprocess import EncodeSettings, Processing, preprocess
from mindspeed_mm.data.video import VideoSettings, decode_video, sample_indices
from mindspeed_mm.models import family_of, load_processing, load_video_processor
from mindspeed_mm.testing import write_tiny_video_dataset
from tests.mm.hf_reference import processor_inputs

VIDEO = VideoSettings(fps=4, maxlen=6, max_pixels=3136, min_pixels=256)


def _processing(model_dir) -> Processing:
    tokenizer, processor = load_processing(model_dir, 784, 12544)
    return Processing(tokenizer, processor, family_of(model_dir), load_video_processor(model_dir))


def test_decoding_follows_llamafactory(tiny_video_data) -> None:
    samples = read_mllm_files([str(tiny_video_data)])
    red = decode_video(samples[0].videos[0], VIDEO, "x")  # 16 frames at 8 fps: 2 s x 4 fps = 8, at most 6
    assert red.indices == [0, 3, 6, 9, 12, 15] and red.fps == 8 and red.sampled_fps == 3
    assert all(f.size == (64, 48) for f in red.frames)  # 3072 pixels: within [256, 3136], unchanged
    blue = decode_video(samples[1].videos[0], VideoSettings(fps=1, maxlen=6, max_pixels=768), "x")
    assert blue.indices == [0, 9] and blue.frames[0].size == (24, 32)  # 2 s x 1 fps; halved to 768 pixels
    folder = decode_video(samples[3].videos[0], VIDEO, "x")  # a frame folder: every frame up to maxlen
    assert folder.indices == [0, 1, 2, 3, 4, 5] and folder.fps == VIDEO.fps
    listed = decode_video(tuple(sorted(str(p) for p in (tiny_video_data.parent / "frames").iterdir())), VIDEO, "x")
    assert [f.tobytes() for f in listed.frames] == [f.tobytes() for f in folder.frames]
    assert sample_indices(100, 50.0, 2.0, 128) == list(range(100))
    assert sample_indices(100, 10.0, 1.0, 128) == [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]
    assert sample_indices(3, 10.0, 2.0, 128) == [0, 1, 2] and sample_indices(50, 0.2, 2.0, 128) == [0]


@pytest.mark.parametrize("fixture", ["tiny_vlm", "tiny_qwen3_vl", "tiny_internvl"])
def test_video_inputs_equal_the_transformers_processor(fixture, tiny_video_data, request) -> None:
    """Tokens, pixels, grids, second_per_grid_ts and token types equal the family's own transformers processor's."""
    processing = _processing(request.getfixturevalue(fixture)[0])
    architecture = processing.family.architecture
    for sample in read_mllm_files([str(tiny_video_data)]):
        out = processor_inputs(processing, sample, VIDEO)
        ours = processing.encode(sample, EncodeSettings(cutoff_len=4096, video=VIDEO))
        assert torch.equal(out["input_ids"][0], ours.input_ids), (architecture, sample.source)
        for key, value in ours.vision.items():
            assert torch.equal(torch.as_tensor(out[key]).to(value.dtype), value), (architecture, key)
        if "mm_token_type_ids" in out:
            assert torch.equal(out["mm_token_type_ids"][0].int(), ours.mm_token_type_ids), architecture
        assert set(ours.vision) <= set(out), (architecture, set(out) - set(ours.vision))


@pytest.mark.parametrize("fixture", ["tiny_vlm", "tiny_qwen3_vl", "tiny_internvl"])
def test_generate_with_video_equals_transformers_generate(fixture, tiny_video_data, request, tmp_path) -> None:
    """``mindspeed-mm generate --video`` (and a prompts file with an image and a video, batched with it) gives
    transformers' greedy ``generate`` on the inputs of transformers' own processor."""
    from mindspeed_mm.cli import main

    model_dir = request.getfixturevalue(fixture)[0]
    samples = read_mllm_files([str(tiny_video_data)])
    prompts = tmp_path / "prompts.jsonl"
    record = json.loads(tiny_video_data.read_text().splitlines()[1])  # an image and a video; answer dropped
    record["messages"] = record["messages"][:1]
    record["images"] = [str(tiny_video_data.parent / p) for p in record["images"]]
    record["videos"] = [str(tiny_video_data.parent / p) for p in record["videos"]]
    prompts.write_text(json.dumps(record) + "\n")
    out = tmp_path / "out.jsonl"
    video = ["--video-fps", "4", "--video-maxlen", "6", "--video-max-pixels", "3136", "--video-min-pixels", "256"]
    argv = ["generate", "--load-dir", str(model_dir), "--video", samples[0].videos[0], "--prompt", "What moves?"]
    argv += ["--prompts-file", str(prompts), "--max-new-tokens", "12", "--output", str(out), "--batch-size", "2"]
    assert main(argv + video + ["--image-min-pixels", "784", "--image-max-pixels", "12544"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    processing = _processing(model_dir)
    model = getattr(transformers, processing.family.architecture).from_pretrained(model_dir, dtype=torch.float32)
    cases = [
        type(samples[0])(({"role": "user", "content": "<video>What moves?"},), (), "p", samples[0].videos),
        type(samples[1])(samples[1].messages[:1], samples[1].images, "p", samples[1].videos),
    ]
    for row, sample in zip(rows, cases, strict=True):
        inputs = processor_inputs(processing, sample, VIDEO, generation=True)
        with torch.no_grad():
            new = model.eval().generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        assert row["prompt_token_ids"] == inputs["input_ids"][0].tolist(), processing.family.architecture
        assert row["token_ids"] == new.tolist() and len(new) == 12, processing.family.architecture


def _write(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_bad_video_samples_name_file_line_and_fix(tmp_path, tiny_vlm, tiny_video_data) -> None:
    video = str(tiny_video_data.parent / "videos" / "red.mp4")
    good = {
        "messages": [{"role": "user", "content": "<video>Hi"}, {"role": "assistant", "content": "Yo"}],
        "videos": [video],
    }
    cases = [
        ({**good, "videos": []}, "1 <video> placeholder(s) but 0 video(s); add the video paths to `videos`"),
        ({**good, "videos": [video, video]}, "1 <video> placeholder(s) but 2 video(s); add <video>"),
        ({**good, "videos": ["missing.mp4"]}, "video 'missing.mp4' not found"),
        ({**good, "videos": [["missing.png"]]}, "video frame 'missing.png' not found"),
        ({**good, "videos": [[]]}, "a video given as a frame list is empty"),
        ({**good, "videos": 3}, "`videos` must be a list of paths (a video: a file, a frame folder"),
    ]
    for record, message in cases:
        name = _write(tmp_path / "d.jsonl", good, record)
        with pytest.raises(ValueError, match=re.escape(f"d.jsonl:2: {message}")):
            read_mllm_files([name])
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 64)
    (tmp_path / "empty").mkdir()
    processing = _processing(tiny_vlm[0])
    for path, message in (
        ("broken.mp4", "video {} cannot be decoded (InvalidDataError"),
        ("empty", "video folder {} holds no frame images"),
    ):
        name = _write(tmp_path / "d.jsonl", good, {**good, "videos": [path]})
        sample = read_mllm_files([name])[1]
        with pytest.raises(ValueError, match=re.escape(f"d.jsonl:2: {message.format(tmp_path / path)}")) as error:
            processing.encode(sample, EncodeSettings(cutoff_len=4096, video=VIDEO))
        assert "re-encode it" in str(error.value) or "add its frames" in str(error.value)
    with pytest.raises(ValueError, match="beyond data.cutoff_len=10; raise data.cutoff_len .* data.video_maxlen"):
        processing.encode(read_mllm_files([str(tiny_video_data)])[0], EncodeSettings(cutoff_len=10, video=VIDEO))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.source == y.source
        and torch.equal(x.input_ids, y.input_ids)
        and torch.equal(x.labels, y.labels)
        and torch.equal(x.mm_token_type_ids, y.mm_token_type_ids)
        and list(x.vision) == list(y.vision)
        and all(v.dtype == y.vision[k].dtype and torch.equal(v, y.vision[k]) for k, v in x.vision.items())
        for x, y in zip(a, b)
    )


def test_cached_parallel_preprocessing(tmp_path, tiny_vlm) -> None:
    """workers=2 equals workers=1; a cache hit returns the same samples bit for bit, faster; any change misses."""
    model_dir = tiny_vlm[0]
    processing = _processing(model_dir)
    data = write_tiny_video_dataset(tmp_path / "data")
    data.write_text(data.read_text() * 4)  # 16 samples
    samples = read_mllm_files([str(data)])
    settings = EncodeSettings(cutoff_len=4096, video=VIDEO)
    cache = str(tmp_path / "cache")

    def run(workers=1, cache_dir=cache, settings=settings, samples=samples):
        return preprocess(samples, processing, settings, workers, cache_dir, [str(data)], model_dir)

    one, about = run(cache_dir=None)
    two, _ = run(workers=2, cache_dir=None)
    assert about["cache"] == "off" and _same(one, two)
    miss, first = run(workers=2)
    hit, second = run()
    assert (first["cache"], second["cache"], first["key"]) == ("miss", "hit", second["key"])
    assert _same(one, miss) and _same(one, hit)
    print(
        f"{len(samples)} samples: encoded in {about['seconds']:.2f} s (1 worker), cache written "
        f"{first['seconds']:.2f} s (2 workers), read back in {second['seconds']:.3f} s"
    )
    assert second["seconds"] < first["seconds"]
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no staging folder left
    changed, third = run(settings=EncodeSettings(cutoff_len=4096, video=VideoSettings(fps=2, maxlen=6)))
    assert third["cache"] == "miss" and third["key"] != first["key"] and not _same(one, changed)
    data.write_text(data.read_text().replace("A red bar.", "A red line."))
    _, fourth = run(samples=read_mllm_files([str(data)]))
    assert fourth["cache"] == "miss" and fourth["key"] not in (first["key"], third["key"])
    time.sleep(0.01)
    (data.parent / "yellow.png").touch()  # a medium's modification time is part of the key
    _, fifth = run(samples=read_mllm_files([str(data)]))
    assert fifth["cache"] == "miss"


def test_a_worker_error_names_the_first_bad_sample(tmp_path, tiny_vlm) -> None:
    data = write_tiny_video_dataset(tmp_path / "data")
    lines = data.read_text().splitlines()
    (data.parent / "videos" / "bad.mp4").write_bytes(b"\x00" * 256)
    bad = lines[0].replace("red.mp4", "bad.mp4")
    data.write_text("\n".join(lines + lines[:2] + [bad] + lines[2:] + [bad]) + "\n")  # bad at lines 7 and 10
    samples = read_mllm_files([str(data)])
    with pytest.raises(ValueError, match=re.escape(f"{data}:7: video {data.parent / 'videos' / 'bad.mp4'} cannot")):
        preprocess(samples, _processing(tiny_vlm[0]), EncodeSettings(cutoff_len=4096, video=VIDEO), 3, None, [], "")
