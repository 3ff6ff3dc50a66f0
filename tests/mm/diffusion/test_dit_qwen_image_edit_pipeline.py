"""Qwen-Image-Edit against ``QwenImageEditPipeline`` on tiny components built in code (the tiny Qwen2.5-VL of
the Qwen-Image tests with its vision tower and processor, an ``AutoencoderKLQwenImage`` with non-trivial
``latents_mean`` / ``latents_std``, the family's tiny transformer):

- the source image's text and latents: the family's ``encode_prompts`` with the images (zero-padded) and its
  mask equal ``encode_prompt`` of the resized images bit for bit (the edit template, 64 states dropped, the
  image's tokens inside); ``image_conditions`` equal ``_encode_vae_image`` of the pipeline's preprocessed image;
- sampling: our loop with true CFG (norm-rescaled) gives ``QwenImageEditPipeline(...)``'s latents and decoded
  image from the same embeddings, source image and initial latents;
- ``mindspeed-mm generate --image SRC`` on the saved pipeline directory writes the pipeline's images pixel for pixel.

The pipeline resizes the source image to about 1024 x 1024 pixels (``calculate_dimensions(1024 * 1024, ratio)``),
which the tiny VAE cannot take in a unit test's time: both it and our :data:`CONDITION_AREA` are set to
64 x 64 here. The source image is twice as wide as high (96 x 32 after the resize: 4 x 12 condition tokens,
target 32 x 32: 4 x 4 tokens).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
from mindspeed_mm.models.dit import DIT_FAMILIES
from mindspeed_mm.models.flux import pack_latents, unpack_latents
from mindspeed_mm.models.qwen_image import text_mask

EDIT = "QwenImageTransformer2DModel:edit"
TEXT_LEN = 400
PROMPTS = ["make the square red", "add a blue circle"]
AREA = 64 * 64


@pytest.fixture(autouse=True)
def small_area(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(AREA, ratio))
    monkeypatch.setattr("mindspeed_mm.models.qwen_image_edit.CONDITION_AREA", AREA)


def _source(seed: int):
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(40, 80, 3) * 255).astype("uint8")  # 80 wide, 40 high
    return Image.fromarray(pixels)


def _tiny_parts(tmp_path) -> dict:
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from mindspeed_mm.models.qwen2_5_vl import write_tiny

    family = DIT_FAMILIES.get(EDIT)
    write_tiny(tmp_path / "qwen2_5_vl")
    torch.manual_seed(0)
    transformer = family.load_class()(**family.tiny_config).eval()
    vae = AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 1.0],
    ).eval()
    return {
        "transformer": transformer,
        "scheduler": build_scheduler(family),
        "vae": vae,
        "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "qwen2_5_vl").eval(),
        "tokenizer": AutoTokenizer.from_pretrained(tmp_path / "qwen2_5_vl"),
        "processor": AutoProcessor.from_pretrained(tmp_path / "qwen2_5_vl"),
    }


def _pipeline_image(pipe, image):
    """The pipeline's resize and preprocessing of the source image (``QwenImageEditPipeline.__call__``'s step 3)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])
    resized = pipe.image_processor.resize(image, height, width)
    return resized, pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)


def test_qwen_image_edit_prompts_and_source_latents_equal_pipeline(tmp_path) -> None:
    from diffusers import QwenImageEditPipeline

    family = DIT_FAMILIES.get(EDIT)
    parts = _tiny_parts(tmp_path)
    pipe = QwenImageEditPipeline(**parts)
    images = [_source(1), _source(2)]
    resized = [_pipeline_image(pipe, image) for image in images]
    assert resized[0][0].size == (96, 32)
    with torch.no_grad():
        theirs, theirs_mask = pipe.encode_prompt(PROMPTS, image=[r[0] for r in resized])
    lengths = theirs_mask.sum(1).tolist()
    assert len(set(lengths)) == 2 and theirs.shape[1] == max(lengths) < TEXT_LEN
    text, pooled = family.encode_prompts(parts, PROMPTS, TEXT_LEN, images=images)
    assert pooled is None and text.shape == (2, TEXT_LEN, 64)
    assert torch.equal(text[:, : theirs.shape[1]], theirs) and not text[:, theirs.shape[1] :].any()
    cut, mask = text_mask(text)
    assert torch.equal(cut, theirs) and torch.equal(mask, theirs_mask)
    # the image's tokens are in the prompt: another image, another text
    other, _ = family.encode_prompts(parts, PROMPTS[:1], TEXT_LEN, images=[_source(3)])
    assert not torch.equal(other[0], text[0])
    for image, (_, pixels) in zip(images, resized):
        ours = family.image_conditions(parts, image, 1, 32, 32)["image_latents"]
        with torch.no_grad():
            expected = pipe._encode_vae_image(pixels, None)[:, :, 0]
        assert ours.shape == (4, 8, 24) and torch.equal(ours, expected[0])
    with pytest.raises(ValueError, match="give --image SRC"):
        family.encode_prompts(parts, PROMPTS, TEXT_LEN)
    with pytest.raises(ValueError, match=r"raise data.text_len \(--text-len\) to at least"):
        family.encode_prompts(parts, PROMPTS, 8, images=images)


def test_qwen_image_edit_sampler_equals_pipeline_with_true_cfg(tmp_path) -> None:
    from diffusers import QwenImageEditPipeline

    family = DIT_FAMILIES.get(EDIT)
    parts = _tiny_parts(tmp_path)
    model, vae, scheduler = parts["transformer"], parts["vae"], parts["scheduler"]
    pipe = QwenImageEditPipeline(**{**parts, "scheduler": copy.deepcopy(scheduler)})
    image = _source(1)
    gen = torch.Generator().manual_seed(6)
    latents = torch.randn(2, 4, 8, 8, generator=gen)
    text, negative = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    text[1, 3:] = 0
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    kwargs = {
        "image": image,
        "prompt_embeds": text,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": negative,
        "negative_prompt_embeds_mask": torch.ones(2, 3, dtype=torch.long),
        "latents": pack_latents(latents),
        "height": 32,
        "width": 32,
        "num_inference_steps": 3,
        "true_cfg_scale": 2.5,
    }
    theirs_latents = unpack_latents(pipe(**kwargs, output_type="latent").images, 8, 8)
    theirs_image = pipe(**kwargs, output_type="pt").images

    def padded(u):
        return torch.cat([u, u.new_zeros(u.shape[0], TEXT_LEN - u.shape[1], u.shape[2])], dim=1)

    source = family.image_conditions(parts, image, 1, 32, 32)["image_latents"]
    conditions = {"image_latents": source.expand(2, -1, -1, -1)}
    ours_latents = sample_latents(
        model,
        family,
        scheduler,
        latents,
        padded(text),
        3,
        negative_text=padded(negative),
        guidance_scale=2.5,
        conditions=conditions,
    )
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    ours_image = decode_latents(vae, ours_latents)
    assert ours_image.shape == theirs_image.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours_image, theirs_image, rtol=1e-6, atol=1e-6)
    # the source matters: another image's latents land elsewhere
    other = family.image_conditions(parts, _source(2), 1, 32, 32)["image_latents"].expand(2, -1, -1, -1)
    moved = sample_latents(
        model,
        family,
        copy.deepcopy(scheduler),
        latents,
        padded(text),
        3,
        negative_text=padded(negative),
        guidance_scale=2.5,
        conditions={"image_latents": other},
    )
    assert (moved - theirs_latents).abs().max() > 1e-3


def test_generate_qwen_image_edit_equals_pipeline(tmp_path, capsys) -> None:
    from diffusers import QwenImageEditPipeline
    from PIL import Image

    from mindspeed_mm.cli import main
    from mindspeed_mm.diffusion.media import to_uint8

    pipe_dir = tmp_path / "pipe"
    QwenImageEditPipeline(**_tiny_parts(tmp_path)).save_pretrained(pipe_dir)
    assert json.loads((pipe_dir / "model_index.json").read_text())["_class_name"] == "QwenImageEditPipeline"
    source = tmp_path / "source.png"
    _source(1).save(source)
    flags = ["--height", "32", "--width", "32", "--num-inference-steps", "3", "--text-len", str(TEXT_LEN)]
    flags += ["--guidance-scale", "3", "--seed", "7", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    flags += ["--batch-size", "1", "--image", str(source)]
    out = tmp_path / "out"
    assert main(["generate", "--load-dir", str(pipe_dir), "--output-dir", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [7, 8] and rows[0]["image"] == str(source)
    reference = QwenImageEditPipeline.from_pretrained(pipe_dir)
    with Image.open(source) as opened:
        image = opened.convert("RGB")
    for index, (row, prompt) in enumerate(zip(rows, PROMPTS)):
        noise = torch.randn((4, 8, 8), generator=torch.Generator().manual_seed(7 + index))[None]
        expected = reference(
            image=image,
            prompt=prompt,
            negative_prompt="",
            latents=pack_latents(noise),
            height=32,
            width=32,
            num_inference_steps=3,
            true_cfg_scale=3.0,
            output_type="pt",
        ).images
        with Image.open(row["files"][0]) as written:
            np.testing.assert_array_equal(np.asarray(written.convert("RGB")), to_uint8(expected)[0])
    capsys.readouterr()
    assert main(["generate", "--load-dir", str(pipe_dir), "--output-dir", str(tmp_path / "none"), *flags[:-2]]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[-1].endswith("is an image-editing model: give --image SRC (the image to edit)")


def test_extract_features_caches_edit_records_as_the_pipeline_encodes_them(tmp_path) -> None:
    """``extract-features`` on (source, target, instruction) records: the cache's ``text`` is ``encode_prompt``'s
    of the instruction with the resized source image (its real tokens), ``image_latents`` ``_encode_vae_image``'s
    of the source, ``null_text`` (with text dropout) ``encode_prompt``'s of the empty prompt with the source and
    ``latents`` the target's; a record without ``condition_image`` is a one-line error naming
    the field; training one step from the cache runs on the source tokens."""
    from diffusers import QwenImageEditPipeline
    from PIL import Image

    from mindspeed.launch import launch
    from mindspeed_mm.cli import main
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.data.features import FeatureSet
    from mindspeed_mm.models.encoders import encode_latents

    pipe_dir = tmp_path / "pipe"
    pipe = QwenImageEditPipeline(**_tiny_parts(tmp_path))
    pipe.save_pretrained(pipe_dir)
    media = tmp_path / "media"
    (media / "src").mkdir(parents=True)
    targets = []
    for i in range(2):
        _source(10 + i).save(media / "src" / f"s{i}.png")
        targets.append((np.random.RandomState(20 + i).rand(32, 32, 3) * 255).astype("uint8"))
        Image.fromarray(targets[-1]).save(media / f"t{i}.png")
    records = [{"path": f"t{i}.png", "cap": PROMPTS[i], "condition_image": f"src/s{i}.png"} for i in range(2)]
    (media / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = [
        f"model.path={pipe_dir / 'transformer'}",
        f"data.files=[{media / 'edits.jsonl'}]",
        "data.resolutions=[[32,32]]",
        f"data.text_len={TEXT_LEN}",
        f"data.features={tmp_path / 'features'}",
        "diffusion.text_dropout=0.5",
    ]
    assert main(["extract-features", *args]) == 0
    cache = FeatureSet(tmp_path / "features")
    for i in range(2):
        with Image.open(media / "src" / f"s{i}.png") as opened:
            resized, pixels = _pipeline_image(pipe, opened.convert("RGB"))
        with torch.no_grad():
            text, mask = pipe.encode_prompt([PROMPTS[i]], image=[resized])
            null, null_mask = pipe.encode_prompt([""], image=[resized])
            source = pipe._encode_vae_image(pixels, None)[0, :, 0]
            target = encode_latents(pipe.vae, torch.tensor(targets[i]).permute(2, 0, 1)[None].float() / 127.5 - 1)
        assert mask is None and torch.equal(cache[i]["text"], text[0])
        assert null_mask is None and torch.equal(cache[i]["null_text"], null[0]) and len(null[0]) < len(text[0])
        assert torch.equal(cache[i]["image_latents"], source)
        torch.testing.assert_close(cache[i]["latents"], target[0], rtol=1e-6, atol=1e-6)
    overrides = [*args, "train.micro_batch_size=2", "train.precision=fp32", "logging.progress=false"]
    task = launch(_one_step, (load_mm_config(None, overrides),))
    assert task["family"] == "QwenImageTransformer2DModel:edit" and task["tokens"] == 16 + 48 and task["finite"]

    (media / "bad.jsonl").write_text(json.dumps({"path": "t0.png", "cap": "no source"}) + "\n")
    bad = [*args[:1], f"data.files=[{media / 'bad.jsonl'}]", *args[2:4], f"data.features={tmp_path / 'bad'}"]
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .* add `condition_image` \(the image to edit\)"):
        _plan(bad)


def _plan(overrides) -> None:
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.data.media_features import MediaFeatures
    from mindspeed_mm.models.dit import dit_family_of

    config = load_mm_config(None, overrides)
    MediaFeatures(config, dit_family_of(config.model.path))


def _one_step(config) -> dict:
    from mindspeed_mm.trainer.task import TASKS

    task = TASKS.get("dit")(config, 1)
    seen = {}
    task.model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    loss, _ = task.loss(task.microbatches(1, 0)[0], torch.zeros(2))
    loss.backward()
    return {"family": task.family.key, "tokens": seen["hidden_states"].shape[1], "finite": bool(loss.isfinite())}
