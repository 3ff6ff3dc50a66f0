"""Video/image + caption data for diffusion transformers: listing, decoding, frame sampling, buckets, bad samples;
``extract-features`` (split over ranks, resumable); training from the cache equals training from the raw media.

- Frames are taken at the target rate from lossless videos and come back with their exact pixel values.
- Bad samples (missing caption, unreadable file, missing file, too few frames, a video for an image model)
  are errors naming the data file and line, or skipped with ``data.skip_bad``.
- Wan: a 1-rank extraction (the CLI), and a 2-rank extraction whose rank 1 was SIGKILLed after each rank
  recorded a shard, then resumed on 1 rank, hold the same index and tensors bit for bit: the shards
  written at 2 ranks equal those at 1, the resumed run skipped the recorded shards and redid the torn one.
- The first losses of training from the cache equal those of training from the raw media (Wan, FLUX, SD3,
  Qwen-Image); SD3's cached text and pooled embeddings equal `StableDiffusion3Pipeline.encode_prompt`'s,
  Qwen-Image's cached text `QwenImagePipeline.encode_prompt`'s.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from mindspeed.launch import RankFailure, launch
from mindspeed_mm.cli import main
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.data.decode import load_pixels
from mindspeed_mm.data.extract import extract_features
from mindspeed_mm.data.media import BadSample, plan_media
from mindspeed_mm.testing.media_fixtures import write_image, write_tiny_pipeline, write_video
from mindspeed_mm.trainer.loop import train


def _ramp(frames: int, height: int, width: int) -> np.ndarray:
    video = np.zeros((frames, height, width, 3), np.uint8)
    for k in range(frames):
        video[k] = 10 * k
    return video


def _noise(seed: int, *shape: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(*shape) * 255).astype(np.uint8)


def test_media_listing_sampling_and_bad_samples(tmp_path) -> None:
    write_video(tmp_path / "v/a.mov", _ramp(12, 20, 28), fps=8)
    write_video(tmp_path / "v/b.mkv", _ramp(20, 16, 32), fps=8, codec="ffv1")  # no frame count in the header
    write_image(tmp_path / "i/c.png", np.full((30, 20, 3), 200, np.uint8))
    (tmp_path / "data.json").write_text(
        json.dumps(
            [
                {"path": "v/a.mov", "cap": "a", "num_frames": 12, "fps": 8, "resolution": {"height": 20, "width": 28}},
                {"path": "v/b.mkv", "cap": ["b", "another"]},
            ]
        )
    )
    (tmp_path / "images.jsonl").write_text(json.dumps({"path": "i/c.png", "cap": "c"}) + "\n")
    files = [str(tmp_path / "data.json"), str(tmp_path / "images.jsonl")]
    samples = plan_media(files, None, [[16, 16], [16, 32]], 16, [5, 9], 4.0, False)
    assert [(s.frames, s.height, s.width, s.caption) for s in samples] == [
        ((0, 2, 4, 6, 8), 16, 16, "a"),
        ((0, 2, 4, 6, 8, 10, 12, 14, 16), 16, 32, "b"),
        ((0,), 16, 16, "c"),
    ]
    pixels = load_pixels(samples[0])
    assert pixels.shape == (3, 5, 16, 16)
    torch.testing.assert_close(
        pixels, (torch.tensor([0, 20, 40, 60, 80.0]) / 127.5 - 1).view(1, 5, 1, 1).expand_as(pixels)
    )
    values = load_pixels(samples[1])[0, :, 3, 5].add(1).mul(127.5)  # ffv1 in yuv420p: within 2 levels
    torch.testing.assert_close(values, torch.arange(0, 180, 20.0), rtol=0, atol=2.0)
    image = load_pixels(samples[2])  # 30 x 20 covers 16 x 16 at 24 x 16, centre crop
    torch.testing.assert_close(image, torch.full((3, 1, 16, 16), 200 / 127.5 - 1))
    (tmp_path / "data.txt").write_text(f"{tmp_path / 'v'},data.json\n\n{tmp_path},images.jsonl\n")
    (tmp_path / "data.json").write_text(json.dumps([{"path": "a.mov", "cap": "a"}, {"path": "b.mkv", "cap": "b"}]))
    assert plan_media([str(tmp_path / "data.txt")], None, [[16, 16], [16, 32]], 16, [5, 9], 4.0, False) == samples
    (tmp_path / "data.json").write_text(json.dumps([{"path": "v/a.mov", "cap": "a"}]))
    every = plan_media(files[:1], None, [], 16, [3], 0.0, False)  # fps 0: consecutive frames; own size floored
    assert every[0].frames == (0, 1, 2) and (every[0].height, every[0].width) == (16, 16)

    write_video(tmp_path / "v/short.mov", _ramp(3, 16, 16), fps=8)
    (tmp_path / "v/broken.mp4").write_bytes(b"not a video at all")
    bad = [
        {"path": "v/a.mov"},
        {"path": "v/broken.mp4", "cap": "x"},
        {"path": "v/gone.mp4", "cap": "x"},
        {"path": "v/short.mov", "cap": "x"},
    ]
    reasons = ["has no caption", "is not a readable video", "does not exist", "has 3 frames at 8 fps: too few"]
    for number, (record, reason) in enumerate(zip(bad, reasons), 2):
        listing = tmp_path / f"bad{number}.json"
        listing.write_text(json.dumps([{"path": "v/a.mov", "cap": "good"}, record]))
        with pytest.raises(BadSample, match=f"bad{number}.json:2: .*{reason}.*data.skip_bad=true"):
            plan_media([str(listing)], None, [], 16, [5], 4.0, False)
    (tmp_path / "all.json").write_text(json.dumps([{"path": "v/a.mov", "cap": "good"}, *bad]))
    kept = plan_media([str(tmp_path / "all.json")], None, [], 16, [5], 4.0, True)
    assert [s.caption for s in kept] == ["good"]
    with pytest.raises(BadSample, match="images.jsonl:1: .*c.png.*|data.json:1: .*a.mov is a video"):
        plan_media(files, None, [], 16, [5], 4.0, False, images_only=True)


def _wan_data(tmp_path) -> list[str]:
    records = []
    for i in range(4):  # 12 frames at 8 fps: 5 frames at 4 fps, 16 x 16
        write_video(tmp_path / f"media/a{i}.mov", _noise(i, 12, 16, 16, 3), fps=8)
        records.append({"path": f"a{i}.mov", "cap": f"clip {i} moves left", "num_frames": 12, "fps": 8})
    for i in range(2):  # 20 frames: 9 frames, 16 x 24 -> the 16 x 32 bucket
        write_video(tmp_path / f"media/b{i}.mov", _noise(10 + i, 20, 16, 24, 3), fps=8)
        records.append({"path": f"b{i}.mov", "cap": f"wide clip {i}"})
    records.append({"path": "a0.mov"})  # no caption: skipped
    (tmp_path / "videos.json").write_text(json.dumps(records))
    for i in range(2):
        write_image(tmp_path / f"media/c{i}.png", _noise(20 + i, 18, 18, 3))
    (tmp_path / "images.jsonl").write_text(
        "".join(json.dumps({"path": f"c{i}.png", "cap": f"still {i}"}) + "\n" for i in range(2))
    )
    return [str(tmp_path / "videos.json"), str(tmp_path / "images.jsonl")]


def _extract(config):
    return extract_features(config)


def _extract_killed(config):
    def stop(shard: int) -> None:
        dist.barrier()  # both ranks have recorded their first shard
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    return extract_features(config, after_shard=stop)


def _train(config):
    return [r["loss"] for r in train(config).records]


def _cache(directory) -> tuple[str, dict[str, torch.Tensor]]:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update({f"{name}/{k}": v for k, v in load_file(str(directory / name)).items()})
    return (directory / "index.jsonl").read_text(), tensors


def _equal(a, b) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        assert torch.equal(a[1][key], b[1][key]), key


TRAIN = [
    "train.steps=2",
    "train.micro_batch_size=2",
    "train.precision=fp32",
    "train.lr=1e-3",
    "diffusion.text_dropout=0.5",
    "logging.progress=false",
]


def test_wan_extract_ranks_resume_and_raw_training(tmp_path) -> None:
    pipeline = write_tiny_pipeline(tmp_path / "wan", "WanTransformer3DModel")
    recipe = {
        "model": {"path": str(pipeline / "transformer")},
        "data": {
            "files": _wan_data(tmp_path),
            "image_dir": str(tmp_path / "media"),
            "resolutions": [[16, 16], [16, 32]],
            "frame_counts": [5, 9],
            "fps": 4,
            "text_len": 12,
            "shard_size": 2,
            "skip_bad": True,
            "features": str(tmp_path / "one"),
        },
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["extract-features", "--config", str(tmp_path / "recipe.yaml")]) == 0
    one = _cache(tmp_path / "one")
    index = [json.loads(line) for line in one[0].splitlines()]
    assert [e["shape"] for e in index] == [[4, 2, 2, 2]] * 4 + [[4, 3, 2, 4]] * 2 + [[4, 1, 2, 2]] * 2
    assert index[5]["source"].endswith("videos.json:6") and index[6]["caption"] == "still 0"
    assert one[1]["null.safetensors/text"].shape[1] == 16  # the byte tokenizer adds no token to ""

    two = tmp_path / "two"
    config = load_mm_config(tmp_path / "recipe.yaml", [f"data.features={two}"])
    with pytest.raises(RankFailure):
        launch(_extract_killed, (config,), nproc_per_node=2)
    assert not (two / "index.jsonl").exists()
    assert (two / "shard-00000.json").is_file() and (two / "shard-00001.json").is_file()  # one by each rank
    assert not (two / "shard-00003.json").exists()
    (two / "shard-00003.safetensors").write_bytes(b"torn")  # a partial write without its record
    result = launch(_extract, (config,))  # resumed on 1 rank: shards 0 and 1 (and maybe 2) are not redone
    assert result.samples == 8 and result.shards == 4 and 1 <= result.written <= 2 and result.bad == 1
    _equal(_cache(two), one)
    assert not list(two.glob("*.tmp"))
    with pytest.raises(ValueError, match="holds an extraction with other"):
        launch(_extract, (load_mm_config(tmp_path / "recipe.yaml", [f"data.features={two}", "data.fps=8"]),))

    cached = launch(_train, (load_mm_config(tmp_path / "recipe.yaml", TRAIN),))
    raw = launch(_train, (load_mm_config(tmp_path / "recipe.yaml", [*TRAIN, "data.features=null"]),))
    assert cached == raw and all(np.isfinite(cached))
    print("wan losses", cached, raw)


def test_flux_raw_training_equals_cached(tmp_path) -> None:
    pipeline = write_tiny_pipeline(tmp_path / "flux", "FluxTransformer2DModel")
    for i in range(4):
        write_image(tmp_path / f"media/{i}.png", _noise(i, 20, 20 + 8 * i, 3))
    (tmp_path / "images.jsonl").write_text(
        "".join(json.dumps({"path": f"media/{i}.png", "cap": f"image {i}"}) + "\n" for i in range(4))
    )
    args = [
        f"model.path={pipeline / 'transformer'}",
        f"data.files=[{tmp_path / 'images.jsonl'}]",
        "data.resolutions=[[16,16],[16,32]]",
        "data.text_len=12",
    ]
    cache = tmp_path / "features"
    result = launch(_extract, (load_mm_config(None, [*args, f"data.features={cache}"]),))
    assert result.samples == 4 and result.written == 1
    shapes = [json.loads(line)["shape"] for line in (cache / "index.jsonl").read_text().splitlines()]
    assert shapes == [[4, 8, 8]] * 2 + [[4, 8, 16]] * 2
    half = tmp_path / "bf16"
    launch(
        _extract,
        (
            load_mm_config(
                None, [*args, f"data.features={half}", "data.vae_dtype=bfloat16", "data.text_encoder_dtype=bfloat16"]
            ),
        ),
    )
    worst = 0.0
    for key, value in _cache(cache)[1].items():  # bf16 encoders: float32 features within bf16's rounding
        low = _cache(half)[1][key]
        assert low.dtype == torch.float32
        worst = max(worst, float((low - value).abs().max() / value.abs().max()))
    assert worst < 0.05
    print("bf16 encoders: largest error / largest value", worst)
    cached = launch(_train, (load_mm_config(None, [*args, *TRAIN, f"data.features={cache}"]),))
    raw = launch(_train, (load_mm_config(None, [*args, *TRAIN]),))
    assert cached == raw and all(np.isfinite(cached))
    print("flux losses", cached, raw)


def test_wan_i2v_extract_caches_first_frame_conditions_and_trains(tmp_path) -> None:
    """Wan I2V: ``extract-features`` caches each video's ``image_latents`` and ``image_embeds``, equal to what
    ``WanImageToVideoPipeline`` computes from the video's first frame as its image (``prepare_latents``'
    latent condition, ``encode_image``); training from the cache equals training from the raw media."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from mindspeed_mm.testing.media_fixtures import tiny_i2v_parts

    pipeline = tmp_path / "i2v"
    WanImageToVideoPipeline(**tiny_i2v_parts()).save_pretrained(pipeline)
    records, videos = [], []
    for i in range(3):
        videos.append(_noise(30 + i, 9, 16, 16, 3))
        write_video(tmp_path / f"media/v{i}.mov", videos[-1], fps=8)
        records.append({"path": f"v{i}.mov", "cap": f"clip {i} turns"})
    (tmp_path / "videos.json").write_text(json.dumps(records))
    args = [
        f"model.path={pipeline / 'transformer'}",
        f"data.files=[{tmp_path / 'videos.json'}]",
        f"data.image_dir={tmp_path / 'media'}",
        "data.resolutions=[[16,16]]",
        "data.frame_counts=[9]",
        "data.fps=8",
        "data.text_len=512",
    ]
    cache = tmp_path / "features"
    result = launch(_extract, (load_mm_config(None, [*args, f"data.features={cache}"]),))
    assert result.samples == 3
    tensors = _cache(cache)[1]
    reference = WanImageToVideoPipeline.from_pretrained(pipeline)
    for i, video in enumerate(videos):
        image = Image.fromarray(video[0])
        pixels = reference.video_processor.preprocess(image, height=16, width=16)
        with torch.no_grad():
            _, condition = reference.prepare_latents(pixels, 1, 4, 16, 16, 9, torch.float32, torch.device("cpu"))
            embeds = reference.encode_image(image, torch.device("cpu"))
        latents = tensors[f"shard-00000.safetensors/{i:06d}.image_latents"]
        assert latents.shape == (4, 3, 2, 2) and tensors[f"shard-00000.safetensors/{i:06d}.image_embeds"].shape == (
            17,
            16,
        )
        torch.testing.assert_close(latents, condition[0, 4:], rtol=0, atol=0)
        torch.testing.assert_close(tensors[f"shard-00000.safetensors/{i:06d}.image_embeds"], embeds[0], rtol=0, atol=0)
    cached = launch(_train, (load_mm_config(None, [*args, *TRAIN, f"data.features={cache}"]),))
    raw = launch(_train, (load_mm_config(None, [*args, *TRAIN]),))
    assert cached == raw and all(np.isfinite(cached))
    print("wan i2v losses", cached, raw)


def test_wan_flf2v_extract_caches_first_and_last_frame_conditions(tmp_path) -> None:
    """Wan FLF2V: ``extract-features`` caches each video's ``image_latents`` and ``image_embeds`` as
    ``WanImageToVideoPipeline`` computes them from the video's first frame as ``image`` and its last as
    ``last_image`` (``prepare_latents(..., last_image=...)``'s latent condition, ``encode_image([image, last])``);
    training from the cache equals training from the raw media."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from mindspeed_mm.testing.media_fixtures import tiny_i2v_parts

    pipeline = tmp_path / "flf2v"
    WanImageToVideoPipeline(**tiny_i2v_parts(flf2v=True)).save_pretrained(pipeline)
    records, videos = [], []
    for i in range(2):
        videos.append(_noise(50 + i, 9, 16, 16, 3))
        write_video(tmp_path / f"media/v{i}.mov", videos[-1], fps=8)
        records.append({"path": f"v{i}.mov", "cap": f"clip {i} turns"})
    (tmp_path / "videos.json").write_text(json.dumps(records))
    args = [
        f"model.path={pipeline / 'transformer'}",
        f"data.files=[{tmp_path / 'videos.json'}]",
        f"data.image_dir={tmp_path / 'media'}",
        "data.resolutions=[[16,16]]",
        "data.frame_counts=[9]",
        "data.fps=8",
        "data.text_len=512",
    ]
    cache = tmp_path / "features"
    assert launch(_extract, (load_mm_config(None, [*args, f"data.features={cache}"]),)).samples == 2
    tensors = _cache(cache)[1]
    reference = WanImageToVideoPipeline.from_pretrained(pipeline)
    for i, video in enumerate(videos):
        first, last = Image.fromarray(video[0]), Image.fromarray(video[-1])
        pixels, last_pixels = (reference.video_processor.preprocess(x, height=16, width=16) for x in (first, last))
        with torch.no_grad():
            _, condition = reference.prepare_latents(
                pixels, 1, 4, 16, 16, 9, torch.float32, torch.device("cpu"), last_image=last_pixels
            )
            embeds = reference.encode_image([first, last], torch.device("cpu"))
        torch.testing.assert_close(
            tensors[f"shard-00000.safetensors/{i:06d}.image_latents"], condition[0, 4:], rtol=0, atol=0
        )
        torch.testing.assert_close(
            tensors[f"shard-00000.safetensors/{i:06d}.image_embeds"], embeds.flatten(0, 1), rtol=0, atol=0
        )
    train_args = [*args, *TRAIN, "train.micro_batch_size=1"]
    cached = launch(_train, (load_mm_config(None, [*train_args, f"data.features={cache}"]),))
    raw = launch(_train, (load_mm_config(None, train_args),))
    assert cached == raw and all(np.isfinite(cached))
    print("wan flf2v losses", cached, raw)


def test_wan_ti2v_extract_with_the_wan22_vae_and_trains(tmp_path) -> None:
    """Wan2.2 TI2V-5B (a ``WanPipeline`` with ``expand_timesteps`` and the Wan2.2 VAE: 48 channels, patch 2,
    residual): ``extract-features`` caches the video's latents, whose first latent frame is what
    ``WanImageToVideoPipeline(expand_timesteps=True).prepare_latents`` makes of the video's first frame as its
    image (the VAE encodes the first frame alone), so training uses it as the image condition; training from the
    cache (half the samples image-to-video) equals training from the raw media."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from mindspeed_mm.models.dit import dit_family_of
    from mindspeed_mm.testing.media_fixtures import tiny_ti2v_parts

    pipeline = tmp_path / "ti2v"
    WanPipeline(**tiny_ti2v_parts(), expand_timesteps=True).save_pretrained(pipeline)
    assert dit_family_of(pipeline / "transformer").key == "WanTransformer3DModel:ti2v"
    records, videos = [], []
    for i in range(3):
        videos.append(_noise(40 + i, 9, 32, 64, 3))
        write_video(tmp_path / f"media/v{i}.mov", videos[-1], fps=8)
        records.append({"path": f"v{i}.mov", "cap": f"clip {i} turns"})
    (tmp_path / "videos.json").write_text(json.dumps(records))
    args = [
        f"model.path={pipeline / 'transformer'}",
        f"data.files=[{tmp_path / 'videos.json'}]",
        f"data.image_dir={tmp_path / 'media'}",
        "data.resolutions=[[32,64]]",
        "data.frame_counts=[9]",
        "data.fps=8",
        "data.text_len=16",
    ]
    cache = tmp_path / "features"
    result = launch(_extract, (load_mm_config(None, [*args, f"data.features={cache}"]),))
    assert result.samples == 3
    tensors = _cache(cache)[1]
    reference = WanImageToVideoPipeline.from_pretrained(pipeline)
    assert reference.config.expand_timesteps
    worst = 0.0
    for i, video in enumerate(videos):
        pixels = reference.video_processor.preprocess(Image.fromarray(video[0]), height=32, width=64)
        with torch.no_grad():
            _, condition, _ = reference.prepare_latents(pixels, 1, 48, 32, 64, 9, torch.float32, torch.device("cpu"))
        latents = tensors[f"shard-00000.safetensors/{i:06d}.latents"]
        assert latents.shape == (48, 3, 2, 4) and condition.shape == (1, 48, 1, 2, 4)
        torch.testing.assert_close(latents[:, :1], condition[0], rtol=0, atol=1e-6)
        worst = max(worst, float((latents[:, :1] - condition[0]).abs().max()))
    train_args = [*args, *TRAIN, "diffusion.first_frame_ratio=0.5"]
    cached = launch(_train, (load_mm_config(None, [*train_args, f"data.features={cache}"]),))
    raw = launch(_train, (load_mm_config(None, train_args),))
    assert cached == raw and all(np.isfinite(cached))
    print(f"wan ti2v: first latent frame vs the pipeline's image latents {worst:.1e}; losses {cached} {raw}")


def test_sd3_extract_caches_pipeline_text_and_trains(tmp_path) -> None:
    """SD3: ``extract-features`` caches per image the three encoders' text (CLIP + CLIP + T5 on the sequence) and
    the two CLIPs' pooled outputs as ``StableDiffusion3Pipeline.encode_prompt`` computes them (on the pipeline
    folders' own parts), and ``(z - shift) x scale`` latents; training from the cache equals training from the
    raw media."""
    from diffusers import AutoencoderKL, StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    pipeline = write_tiny_pipeline(tmp_path / "sd3", "SD3Transformer2DModel")
    for i in range(3):
        write_image(tmp_path / f"media/{i}.png", _noise(40 + i, 16, 16, 3))
    captions = [f"image {i}" for i in range(3)]
    (tmp_path / "images.jsonl").write_text(
        "".join(json.dumps({"path": f"media/{i}.png", "cap": c}) + "\n" for i, c in enumerate(captions))
    )
    args = [
        f"model.path={pipeline / 'transformer'}",
        f"data.files=[{tmp_path / 'images.jsonl'}]",
        "data.resolutions=[[16,16]]",
        "data.text_len=14",  # CLIP's 10 + T5's 4
    ]
    cache = tmp_path / "features"
    result = launch(_extract, (load_mm_config(None, [*args, f"data.features={cache}"]),))
    assert result.samples == 3
    tensors = _cache(cache)[1]

    def load(cls, name):
        return cls.from_pretrained(pipeline / name).eval()

    reference = StableDiffusion3Pipeline(
        transformer=None,
        scheduler=None,
        vae=load(AutoencoderKL, "vae"),
        text_encoder=load(CLIPTextModelWithProjection, "text_encoder"),
        text_encoder_2=load(CLIPTextModelWithProjection, "text_encoder_2"),
        text_encoder_3=load(T5EncoderModel, "text_encoder_3"),
        tokenizer=AutoTokenizer.from_pretrained(pipeline / "tokenizer"),
        tokenizer_2=AutoTokenizer.from_pretrained(pipeline / "tokenizer_2"),
        tokenizer_3=AutoTokenizer.from_pretrained(pipeline / "tokenizer_3"),
    )
    for i, caption in enumerate(captions):
        (text,) = [v for k, v in tensors.items() if k.endswith(f"{i:06d}.text")]
        (pooled,) = [v for k, v in tensors.items() if k.endswith(f"{i:06d}.pooled")]
        (latents,) = [v for k, v in tensors.items() if k.endswith(f"{i:06d}.latents")]
        with torch.no_grad():
            theirs, _, theirs_pooled, _ = reference.encode_prompt(
                caption, None, None, do_classifier_free_guidance=False, max_sequence_length=4
            )
        assert text.shape == (14, 48) and pooled.shape == (32,) and latents.shape == (4, 8, 8)
        torch.testing.assert_close(text, theirs[0], rtol=0, atol=0)
        torch.testing.assert_close(pooled, theirs_pooled[0], rtol=0, atol=0)
    cached = launch(_train, (load_mm_config(None, [*args, *TRAIN, f"data.features={cache}"]),))
    raw = launch(_train, (load_mm_config(None, [*args, *TRAIN]),))
    assert cached == raw and all(np.isfinite(cached))
    print("sd3 losses", cached, raw)


def test_qwen_image_extract_caches_pipeline_text_and_trains(tmp_path) -> None:
    """Qwen-Image: ``extract-features`` caches per image the real tokens of ``QwenImagePipeline.encode_prompt``
    (on the pipeline folders' own parts) and the 3-D VAE's one-frame latents normalised with ``latents_mean`` /
    ``latents_std`` (the frame axis dropped); training from the cache equals training from the raw media."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from mindspeed_mm.diffusion.sampler import decode_latents

    pipeline = write_tiny_pipeline(tmp_path / "qwen-image", "QwenImageTransformer2DModel")
    for i in range(3):
        write_image(tmp_path / f"media/{i}.png", _noise(50 + i, 16, 16, 3))
    captions = ["image 0", "a longer caption of image 1", "2"]
    (tmp_path / "images.jsonl").write_text(
        "".join(json.dumps({"path": f"media/{i}.png", "cap": c}) + "\n" for i, c in enumerate(captions))
    )
    args = [
        f"model.path={pipeline / 'transformer'}",
        f"data.files=[{tmp_path / 'images.jsonl'}]",
        "data.resolutions=[[16,16]]",
        "data.text_len=256",
    ]
    cache = tmp_path / "features"
    result = launch(_extract, (load_mm_config(None, [*args, f"data.features={cache}"]),))
    assert result.samples == 3
    tensors = _cache(cache)[1]
    vae = AutoencoderKLQwenImage.from_pretrained(pipeline / "vae").eval()
    reference = QwenImagePipeline(
        transformer=None,
        scheduler=None,
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(pipeline / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(pipeline / "tokenizer"),
    )
    lengths = []
    for i, caption in enumerate(captions):
        (text,) = [v for k, v in tensors.items() if k.endswith(f"{i:06d}.text")]
        (latents,) = [v for k, v in tensors.items() if k.endswith(f"{i:06d}.latents")]
        with torch.no_grad():
            theirs, mask = reference.encode_prompt(caption, max_sequence_length=256)
        assert mask is None and latents.shape == (4, 4, 4)
        torch.testing.assert_close(text, theirs[0], rtol=0, atol=0)
        lengths.append(text.shape[0])
        # the pipeline's decode of the cached latents (its un-normalisation, one frame) is ours
        z = latents[None, :, None] * torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
        z = z + torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
        with torch.no_grad():
            pixels = (vae.decode(z, return_dict=False)[0][:, :, 0] * 0.5 + 0.5).clamp(0, 1)
        torch.testing.assert_close(decode_latents(vae, latents[None]), pixels, rtol=1e-6, atol=1e-6)
    assert len(set(lengths)) == 3  # three text lengths: training pads and masks them
    cached = launch(_train, (load_mm_config(None, [*args, *TRAIN, f"data.features={cache}"]),))
    raw = launch(_train, (load_mm_config(None, [*args, *TRAIN]),))
    assert cached == raw and all(np.isfinite(cached))
    print("qwen-image losses", cached, raw)
