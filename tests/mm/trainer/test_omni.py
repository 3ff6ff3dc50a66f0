"""Qwen2.5-Omni's thinker on audio (and image + audio) samples, against transformers.

- Encoding: our encoded sample (tokens, ``input_features``, ``feature_attention_mask``, image patches
  and grids) equals ``Qwen2_5OmniProcessor``'s output for the same conversation and decoded clips.
- First step: the trainer's first loss and gradient norm equal transformers' own loss computed
  sample by sample (its own 3-D positions from ``get_rope_index`` with the audio lengths, its own
  label shift), also when encoded by 2 worker processes into ``data.cache_dir`` and read back; and every gradient of the packed forward through the suite's attention equals the
  sum of the per-sample reference gradients (a video + audio sample among them: four frames, not
  interleaved, ``use_audio_in_video=False``); a packed row without sample boundaries, or with 1-D
  positions, misses it.
- Bad input: a count mismatch between ``<audio>`` and ``audios``, a missing clip, a file that is not
  a .wav, and an audio sample for a family without audio are each a one-line ``ValueError``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.data import pack_samples, read_mllm_files
from mindspeed_mm.data.audio import decode_audio
from mindspeed_mm.data.mllm_check import check_mllm_media
from mindspeed_mm.data.preprocess import EncodeSettings, Processing
from mindspeed_mm.data.video import VideoSettings, decode_video
from mindspeed_mm.models import family_of, load_audio_processor, load_model, load_processing, load_video_processor
from mindspeed_mm.testing import write_tiny_audio_dataset, write_tiny_model
from mindspeed_mm.trainer.loop import train
from mindspeed_mm.trainer.loss import token_losses
from mindspeed_mm.trainer.sequence_parallel import SequenceParallel

OMNI = "Qwen2_5OmniThinkerForConditionalGeneration"
SAMPLES = 7  # audio, audio, image + audio, text only, audio, image + audio, video + audio (4 frames)


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-omni")
    return write_tiny_model(root / "omni", OMNI), write_tiny_audio_dataset(
        root / "data", num_samples=SAMPLES, video_every=7
    )


def _processing(model_dir: Path) -> Processing:
    tokenizer, processor = load_processing(model_dir, 28 * 28, 112 * 112)
    family = family_of(model_dir)
    return Processing(tokenizer, processor, family, load_video_processor(model_dir), load_audio_processor(model_dir))


def test_encoding_equals_qwen2_5_omni_processor(tiny_omni) -> None:
    from PIL import Image
    from transformers import Qwen2_5OmniProcessor

    from mindspeed_mm.models.qwen2_5_omni import TOKEN_ATTRIBUTES

    model_dir, data = tiny_omni
    processing = _processing(model_dir)
    tokenizer, family = processing.tokenizer, processing.family
    for name, token in TOKEN_ATTRIBUTES.items():  # the released tokenizer's extra special tokens
        setattr(tokenizer, name, token)
    videos = load_video_processor(model_dir)
    processor = Qwen2_5OmniProcessor(
        image_processor=processing.image_processor,
        video_processor=videos,
        feature_extractor=processing.audio_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    rate = processing.audio_processor.sampling_rate
    audio_tokens = []
    for sample in read_mllm_files([str(data)]):
        ours = processing.encode(sample, EncodeSettings(cutoff_len=1024))
        messages = [
            {
                "role": m["role"],
                "content": m["content"]
                .replace("<audio>", family.audio_placeholder)
                .replace("<image>", family.image_placeholder)
                .replace("<video>", family.video_placeholder),
            }
            for m in sample.messages
        ]
        clips = [decode_video(video, VideoSettings(), sample.source) for video in sample.videos]
        theirs = processor(
            text=[tokenizer.apply_chat_template(messages, tokenize=False)],
            audio=[decode_audio(path, rate, sample.source) for path in sample.audios] or None,
            images=[Image.open(path).convert("RGB") for path in sample.images] or None,
            videos=[clip.frames for clip in clips] or None,
            video_metadata=[clip.metadata() for clip in clips] or None,
            do_sample_frames=False,
            videos_kwargs={"size": dict(videos.size)},  # the directory's bounds, not the 7B's call default
            return_tensors="pt",
        )
        assert torch.equal(theirs["input_ids"][0], ours.input_ids), sample.source
        keys = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")
        keys += ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")
        expected = {k for k in keys if k in theirs}
        assert set(ours.vision) == expected, sample.source
        for key in expected:
            assert torch.equal(torch.as_tensor(theirs[key]).to(ours.vision[key].dtype), ours.vision[key]), key
        audio_tokens.append(int((ours.mm_token_type_ids == 3).sum()))
    print(f"audio tokens per sample: {audio_tokens}")
    assert len({n for n in audio_tokens if n}) > 1  # clips of different lengths


def _reference(model_dir: Path, data: Path):
    """Per sample: transformers' loss (its own positions from attention_mask + feature mask), tokens, grads."""
    processing = _processing(model_dir)
    model = load_model(model_dir, processing.family, "sdpa")
    encoded = [processing.encode(s, EncodeSettings(cutoff_len=1024)) for s in read_mllm_files([str(data)])]
    losses, counts, grads = [], [], []
    for sample in encoded:
        ids = sample.input_ids[None]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": sample.labels[None]}
        model.zero_grad()
        loss = model(**inputs, **sample.vision, use_cache=False).loss
        (loss * sample.num_label_tokens).backward()
        losses.append(float(loss.detach()))
        counts.append(sample.num_label_tokens)
        grads.append(
            {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )
    return processing, encoded, losses, counts, grads


def _train_rank(config):
    return train(config)


def test_first_step_equals_transformers(tiny_omni, tmp_path) -> None:
    model_dir, data = tiny_omni
    processing, encoded, losses, counts, grads = _reference(model_dir, data)
    n = sum(counts)
    per_token = sum(loss * c for loss, c in zip(losses, counts)) / n
    expected = {name: sum(g[name] for g in grads) / n for name in grads[0]}
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in expected.values())))

    common = [
        f"model.path={model_dir}",
        f"data.files=[{data}]",
        "data.shuffle=false",
        "train.steps=1",
        f"train.micro_batch_size={SAMPLES}",
        "train.precision=fp32",
        "train.clip_grad=0",
        "logging.progress=false",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
        f"logging.dir={tmp_path}",
    ]
    # encoded in this process, and in 2 worker processes into a cache (then read back from it)
    cache = ["data.workers=2", f"data.cache_dir={tmp_path / 'cache'}"]
    for overrides in (common, common + cache, common + cache):
        record = launch(_train_rank, (load_mm_config(None, overrides),)).records[0]
        assert record["loss"] == pytest.approx(per_token, rel=1e-6)
        assert record["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert len(list((tmp_path / "cache").iterdir())) == 1

    # Every gradient: the packed row through the suite's attention (sample boundaries from the trainer's hook).
    model = load_model(model_dir, processing.family)
    batch = pack_samples(encoded, model, processing.family)
    sequence = SequenceParallel(model, processing.family)
    sequence.begin(batch.sample_index)
    logits = model(**batch.model_inputs(torch.device("cpu"))).logits[0]
    loss = token_losses(logits, batch.targets).sum() / batch.num_label_tokens
    loss.backward()
    assert float(loss.detach()) == pytest.approx(per_token, rel=1e-6)
    worst = 0.0
    for name, param in model.named_parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad  # unused: audio_bos_eos_token
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
        worst = max(worst, float((grad - expected[name]).abs().max()))
    assert float(expected["audio_tower.conv1.weight"].abs().sum()) > 0  # the audio encoder learns
    sequence.remove()

    # Without the sample boundaries (one causal row), the loss misses the reference.
    with torch.no_grad():
        ref_model = load_model(model_dir, processing.family, "sdpa")
        inputs = {**batch.model_inputs(torch.device("cpu"))}
        inputs["position_ids"] = inputs["position_ids"][1:]  # no text row: transformers builds one causal mask
        unbounded = token_losses(ref_model(**inputs).logits[0], batch.targets).sum() / batch.num_label_tokens
        inputs["position_ids"] = batch.position_ids[:1].expand(4, -1, -1)  # text positions on the rotary axes
        one_d = token_losses(ref_model(**inputs).logits[0], batch.targets).sum() / batch.num_label_tokens
    assert abs(float(one_d) - per_token) > 1e-4  # the image and video grid positions matter
    print(
        f"Omni packed loss {per_token:.6f}, grad norm {norm:.6f}, worst gradient error {worst:.2e}, "
        f"error without boundaries {abs(float(unbounded) - per_token):.2e}, with 1-D positions "
        f"{abs(float(one_d) - per_token):.2e}"
    )
    assert abs(float(unbounded) - per_token) > 1e-4


def test_bad_audio_input_is_one_line(tiny_omni, tmp_path) -> None:
    model_dir, data = tiny_omni
    clip = str(data.parent / "audio" / "0000.wav")

    def sample(record: dict) -> Path:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(record) + "\n")
        return path

    turns = [{"role": "user", "content": "<audio>Which pitch?"}, {"role": "assistant", "content": "low"}]
    cases = {
        "placeholder": ({"messages": turns, "audios": [clip, clip]}, "1 <audio> placeholder(s) but 2 audio(s)"),
        "missing": ({"messages": turns, "audios": ["nowhere.wav"]}, "audio 'nowhere.wav' not found"),
    }
    for name, (record, message) in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            read_mllm_files([str(sample(record))])
        assert "\n" not in str(info.value), name
    not_wav = tmp_path / "noise.wav"
    not_wav.write_bytes(b"not a wav file at all")
    samples = read_mllm_files([str(sample({"messages": turns, "audios": [str(not_wav)]}))])
    with pytest.raises(ValueError, match="cannot be read as a PCM .wav") as info:
        check_mllm_media(samples, skip_bad=False)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="cannot be read as a PCM .wav"):
        decode_audio(str(not_wav), 16000, "x")
    processing = _processing(model_dir)
    audio_only = read_mllm_files([str(sample({"messages": turns, "audios": [clip]}))])[0]
    with pytest.raises(ValueError, match="audio tokens end at token .* beyond data.cutoff_len=8") as info:
        processing.encode(audio_only, EncodeSettings(cutoff_len=8))
    assert "\n" not in str(info.value)
    from mindspeed_mm.inference.prompts import prompt_from_text

    with pytest.raises(ValueError, match="--audio 'nowhere.wav' does not exist"):
        prompt_from_text("Which pitch?", [], None, (), ["nowhere.wav"])
    with pytest.raises(ValueError, match="1 <audio> placeholder"):
        prompt_from_text("<audio>Which pitch?", [], None, (), [clip, clip])
    # A Qwen2.5-VL model takes no audio.
    vl = write_tiny_model(tmp_path / "vl")
    with pytest.raises(ValueError, match="takes no audio"):
        load_audio_processor(vl)
    tokenizer, processor = load_processing(vl, 784, 12544)
    audio_sample = read_mllm_files([str(sample({"messages": turns, "audios": [clip]}))])[0]
    with pytest.raises(ValueError, match="takes no audio here"):
        Processing(tokenizer, processor, family_of(vl)).encode(audio_sample, EncodeSettings(cutoff_len=512))


def test_resampling_keeps_a_tone(tmp_path) -> None:
    """A 440 Hz tone written at 8 kHz is decoded at 16 kHz with twice the samples and the same pitch."""
    import numpy as np

    from mindspeed_mm.data.audio import write_wav

    t = np.arange(8000) / 8000
    write_wav(str(tmp_path / "a.wav"), 0.5 * np.sin(2 * np.pi * 440 * t), 8000)
    wave = decode_audio(str(tmp_path / "a.wav"), 16000, "x")
    assert wave.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(float(np.argmax(spectrum)) * 16000 / wave.size - 440) < 2
