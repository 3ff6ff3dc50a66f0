"""``mindspeed-mm generate`` on a diffusers model: files, seeds, the three ways to name the weights, errors.

A tiny Wan pipeline (the demo's layout: ``WanTransformer3DModel``, a fixed patch VAE, a tiny UMT5)
samples two prompts with guidance: one ``.gif`` per prompt of the asked frames and size, a contact
sheet (``.png`` and ``.gif``), ``samples.jsonl`` with each prompt's seed. The transformer directory
with ``--pipeline-dir`` and a DCP checkpoint of the same weights with ``--base-dir`` write the
same bytes; the first video equals the library sampler run by hand (same seed, prompt encoding,
negative prompt), and so does ``--sampler unipc`` with a user's ``--negative-prompt`` (each of the two changes the
sample; the same command writes the same bytes); ``--ring-attention-size 2`` (two spawned ranks, each with half of every
video's tokens, ring attention; each decodes one of the two videos) writes the same videos. (The sampler itself is proven against ``WanPipeline`` / ``FluxPipeline`` in
``test_dit_sampler.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from mindspeed_mm.cli import main
from mindspeed_mm.demos.t2v import write_demo_pipeline
from mindspeed_mm.diffusion.media import mp4_available

FLAGS = [
    "--num-frames",
    "3",
    "--height",
    "8",
    "--width",
    "8",
    "--num-inference-steps",
    "2",
    "--text-len",
    "8",
    "--guidance-scale",
    "3",
    "--seed",
    "7",
    "--prompt",
    "a red square moving left",
    "--prompt",
    "a blue circle moving up",
]


def _gif_frames(path) -> np.ndarray:
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)])


def test_generate_dit_files_seeds_and_sources(tmp_path, capsys) -> None:
    from mindspeed_mm.diffusion.sampler import SAMPLERS, build_scheduler, decode_latents, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline

    pipe = write_demo_pipeline(tmp_path / "pipe")
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(tmp_path / "a"), *FLAGS]) == 0
    rows = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [7, 8] and rows[1]["prompt"] == "a blue circle moving up"
    assert rows[0]["settings"]["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    first = _gif_frames(tmp_path / "a" / "000-a-red-square-moving-left.gif")
    assert first.shape == (3, 8, 8, 3)
    assert (tmp_path / "a" / "contact_sheet.png").is_file() and (tmp_path / "a" / "contact_sheet.gif").is_file()
    if mp4_available():  # PyAV: an H.264 file of 3 frames
        import av

        with av.open(str(tmp_path / "a" / "000-a-red-square-moving-left.mp4")) as video:
            assert sum(1 for _ in video.decode(video=0)) == 3

    # the same video by hand from the library: seed 7's noise, the prompt and the empty negative prompt encoded
    loaded = load_dit_pipeline(pipe)
    family = loaded.family
    noise = torch.randn(latent_shape(loaded.parts["vae"], family, 3, 8, 8), generator=torch.Generator().manual_seed(7))
    text, _ = family.encode_prompts(loaded.parts, ["a red square moving left"], 8)
    negative, _ = family.encode_prompts(loaded.parts, [""], 8)
    latents = sample_latents(
        loaded.model,
        family,
        build_scheduler(family, pipe),
        noise[None],
        text,
        2,
        negative_text=negative,
        guidance_scale=3.0,
    )
    expected = (decode_latents(loaded.parts["vae"], latents)[0].permute(0, 2, 3, 1).numpy() * 255).round()
    assert np.abs(first.astype(np.float64) - expected).max() <= 8  # GIF's palette rounds a few levels at most

    # --sampler unipc with a user's --negative-prompt: the library sampler with diffusers' UniPC (flow mode) and
    # that prompt's encoding as the negative text, from the same seed's noise
    steer = "a green triangle moving down"
    unipc = ["--sampler", "unipc", "--negative-prompt", steer]
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(tmp_path / "u"), *FLAGS, *unipc]) == 0
    rows = [json.loads(line) for line in (tmp_path / "u" / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["settings"]["scheduler"] == "UniPCMultistepScheduler"
    assert rows[0]["settings"]["negative_prompt"] == steer and [r["seed"] for r in rows] == [7, 8]
    by_cli = _gif_frames(tmp_path / "u" / "000-a-red-square-moving-left.gif")
    steered, _ = family.encode_prompts(loaded.parts, [steer], 8)
    by_hand = {}
    for name, sampler, negative_text in (
        ("unipc", "unipc", steered),
        ("unipc_empty", "unipc", negative),
        ("euler_steered", "euler", steered),
    ):
        scheduler = build_scheduler(family, pipe, sampler)
        assert type(scheduler).__name__ == ("UniPCMultistepScheduler" if sampler == "unipc" else SAMPLERS["euler"])
        by_hand[name] = sample_latents(
            loaded.model, family, scheduler, noise[None], text, 2, negative_text=negative_text, guidance_scale=3.0
        )
    pixels = {
        name: (decode_latents(loaded.parts["vae"], z)[0].permute(0, 2, 3, 1).numpy() * 255).round()
        for name, z in by_hand.items()
    }
    assert np.abs(by_cli.astype(np.float64) - pixels["unipc"]).max() <= 8
    # each choice matters, beyond the GIF's rounding: the negative prompt (measured: 28 levels) and the sampler
    # (37 levels from Euler with the same negative prompt)
    assert np.abs(by_cli.astype(np.float64) - pixels["unipc_empty"]).max() > 16
    assert np.abs(by_cli.astype(np.float64) - pixels["euler_steered"]).max() > 16
    assert (latents - by_hand["euler_steered"]).abs().max() > 1e-3 * latents.abs().max()  # Euler: steered or not
    # and deterministic by seed: the same command writes the same bytes
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(tmp_path / "u2"), *FLAGS, *unipc]) == 0
    for name in ("000-a-red-square-moving-left.gif", "001-a-blue-circle-moving-up.gif", "contact_sheet.png"):
        assert (tmp_path / "u2" / name).read_bytes() == (tmp_path / "u" / name).read_bytes(), name
    assert (tmp_path / "u" / "contact_sheet.png").read_bytes() != (tmp_path / "a" / "contact_sheet.png").read_bytes()

    # a transformer directory with --pipeline-dir, and a DCP checkpoint with --base-dir: the same files
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(pipe / "transformer"),
                "--pipeline-dir",
                str(pipe),
                "--output-dir",
                str(tmp_path / "b"),
                *FLAGS,
            ]
        )
        == 0
    )
    state = {f"{k}": v for k, v in loaded.model.state_dict().items()}
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "save" / "step_00000001"), no_dist=True)
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(tmp_path / "save" / "step_00000001"),
                "--base-dir",
                str(pipe / "transformer"),
                "--output-dir",
                str(tmp_path / "c"),
                *FLAGS,
            ]
        )
        == 0
    )
    for other in ("b", "c"):
        for name in (
            "000-a-red-square-moving-left.gif",
            "001-a-blue-circle-moving-up.gif",
            "contact_sheet.png",
            "contact_sheet.gif",
        ):
            assert (tmp_path / other / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), (other, name)

    # sequence-parallel sampling: two spawned ranks share each video's tokens (the ring; Ulysses and USP are
    # proven in test_dit_sequence_parallel.py) and decode one video each; rank 0 writes the same videos
    sp2 = ["generate", "--load-dir", str(pipe), "--output-dir", str(tmp_path / "e"), "--ring-attention-size", "2"]
    assert main([*sp2, *FLAGS]) == 0
    for name in ("000-a-red-square-moving-left.gif", "001-a-blue-circle-moving-up.gif"):
        one, two = _gif_frames(tmp_path / "a" / name), _gif_frames(tmp_path / "e" / name)
        assert np.abs(one.astype(int) - two.astype(int)).max() <= 1, name
    assert len((tmp_path / "e" / "samples.jsonl").read_text().splitlines()) == 2

    assert (
        main(["generate", "--load-dir", str(tmp_path / "save" / "step_00000001"), "--pipeline-dir", str(pipe), *FLAGS])
        == 2
    )
    assert "--base-dir" in capsys.readouterr().err
    assert (
        main(["generate", "--load-dir", str(pipe), "--output-dir", str(tmp_path / "d"), *FLAGS, "--height", "6"]) == 2
    )
    assert "multiples of 4" in capsys.readouterr().err


def test_generate_flux_images_and_contact_sheet(tmp_path) -> None:
    """FLUX (the text-to-image demo's pipeline layout: CLIP + T5, the patch VAE): one ``.png`` per prompt equal to
    the library sampler run by hand (pooled embeddings and guidance included), a contact sheet, samples.jsonl."""
    from PIL import Image

    from mindspeed_mm.demos.t2i import write_t2i_pipeline
    from mindspeed_mm.diffusion.media import to_uint8
    from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline

    pipe = write_t2i_pipeline(tmp_path / "pipe")
    prompts = ["a red square in the top left", "a blue circle in the bottom right"]
    flags = ["--height", "8", "--width", "8", "--num-inference-steps", "2", "--text-len", "10"]
    flags += ["--guidance-scale", "3", "--seed", "7", "--prompt", prompts[0], "--prompt", prompts[1]]
    out = tmp_path / "out"
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [7, 8] and rows[1]["prompt"] == prompts[1]
    assert rows[0]["settings"]["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    files = [out / "000-a-red-square-in-the-top-left.png", out / "001-a-blue-circle-in-the-bottom-right.png"]
    assert [Path(f) for r in rows for f in r["files"]] == files
    with Image.open(out / "contact_sheet.png") as sheet:
        assert sheet.width >= 2 * 8 and sheet.height > 8  # two cells side by side, captions below
    assert not (out / "contact_sheet.gif").exists()

    loaded = load_dit_pipeline(pipe)
    family = loaded.family
    shape = latent_shape(loaded.parts["vae"], family, 1, 8, 8)
    assert shape == (12, 4, 4)
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(7 + i)) for i in range(2)])
    text, pooled = family.encode_prompts(loaded.parts, prompts, 10)
    negative, negative_pooled = family.encode_prompts(loaded.parts, [""], 10)
    latents = sample_latents(
        loaded.model,
        family,
        build_scheduler(family, pipe),
        noise,
        text,
        2,
        pooled,
        negative.expand(2, -1, -1),
        negative_pooled.expand(2, -1),
        3.0,
    )
    expected = to_uint8(decode_latents(loaded.parts["vae"], latents))
    for file, image in zip(files, expected):
        with Image.open(file) as written:
            assert written.size == (8, 8)
            np.testing.assert_array_equal(np.asarray(written.convert("RGB")), image)  # PNG is lossless


def test_generate_wan22_two_experts(tmp_path, capsys) -> None:
    """A pipeline with ``transformer_2`` and ``boundary_ratio``: both experts sample, as the library sampler by hand."""
    from diffusers import WanTransformer3DModel

    from mindspeed_mm.demos.t2v import TINY_WAN
    from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline

    pipe = write_demo_pipeline(tmp_path / "pipe")
    torch.manual_seed(3)
    WanTransformer3DModel(**TINY_WAN).save_pretrained(str(pipe / "transformer_2"))
    index = json.loads((pipe / "model_index.json").read_text())
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (pipe / "model_index.json").write_text(json.dumps(index))
    flags = [*FLAGS, "--guidance-scale-2", "2", "--num-inference-steps", "3"]  # timesteps 1000, 500.5, 1
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(tmp_path / "a"), *flags]) == 0
    rows = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["settings"]["boundary_ratio"] == 0.875 and rows[0]["settings"]["guidance_scale_2"] == 2.0
    by_cli = _gif_frames(tmp_path / "a" / "000-a-red-square-moving-left.gif")

    loaded = load_dit_pipeline(pipe)
    family = loaded.family
    second = WanTransformer3DModel.from_pretrained(pipe / "transformer_2").eval()
    noise = torch.randn(latent_shape(loaded.parts["vae"], family, 3, 8, 8), generator=torch.Generator().manual_seed(7))
    text, _ = family.encode_prompts(loaded.parts, ["a red square moving left"], 8)
    negative, _ = family.encode_prompts(loaded.parts, [""], 8)
    pixels = {}
    for name, extra in (("pair", {"model_2": second, "boundary_ratio": 0.875, "guidance_scale_2": 2.0}), ("alone", {})):
        scheduler = build_scheduler(family, pipe)
        latents = sample_latents(
            loaded.model, family, scheduler, noise[None], text, 3, negative_text=negative, guidance_scale=3.0, **extra
        )
        pixels[name] = (decode_latents(loaded.parts["vae"], latents)[0].permute(0, 2, 3, 1).numpy() * 255).round()
    assert np.abs(by_cli.astype(np.float64) - pixels["pair"]).max() <= 8  # GIF's palette rounds a few levels
    assert np.abs(by_cli.astype(np.float64) - pixels["alone"]).max() > 16  # the second expert took steps
    # --guidance-scale-2 without a second expert (another transformer with this pipeline's parts) is refused
    import shutil

    shutil.copytree(pipe / "transformer", tmp_path / "alone")
    single = ["generate", "--load-dir", str(tmp_path / "alone"), "--pipeline-dir", str(pipe)]
    assert main([*single, "--output-dir", str(tmp_path / "b"), *flags]) == 2
    assert "--guidance-scale-2 applies to a Wan2.2 pipeline" in capsys.readouterr().err


def test_generate_wan_i2v_equals_wan_image_to_video_pipeline(tmp_path, capsys) -> None:
    """``generate --image`` on a tiny Wan2.1 I2V pipeline directory (UMT5, CLIP vision, VAE, UniPC) writes the
    videos that diffusers' ``WanImageToVideoPipeline.from_pretrained`` of the same directory makes from the same
    prompts, image, seed noise and empty negative prompt (written through the same GIF writer).

    The prompts go in encoded by ``WanPipeline.encode_prompt`` on the same components: diffusers 0.42's
    ``pipeline_wan_i2v.basic_clean`` calls ftfy unguarded (``WanPipeline``'s checks ``is_ftfy_available``),
    and the I2V pipeline's ``encode_prompt`` is marked a copy of ``WanPipeline``'s."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from mindspeed_mm.diffusion import media
    from mindspeed_mm.testing.media_fixtures import tiny_i2v_parts, write_image

    pipe = tmp_path / "pipe"
    WanImageToVideoPipeline(**tiny_i2v_parts()).save_pretrained(pipe)
    pixels = (np.random.default_rng(3).random((20, 24, 3)) * 255).astype(np.uint8)
    image = write_image(tmp_path / "first.png", pixels)
    prompts = ["a red square moving left", "a blue circle moving up"]
    flags = ["--num-frames", "9", "--height", "16", "--width", "16", "--num-inference-steps", "3"]
    flags += ["--guidance-scale", "3", "--seed", "7", "--image", str(image)]
    out = tmp_path / "out"
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(pipe),
                "--output-dir",
                str(out),
                *flags,
                "--prompt",
                prompts[0],
                "--prompt",
                prompts[1],
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["image"] for r in rows] == [str(image)] * 2 and [r["seed"] for r in rows] == [7, 8]

    reference = WanImageToVideoPipeline.from_pretrained(pipe)
    text_pipe = WanPipeline(
        tokenizer=reference.tokenizer,
        text_encoder=reference.text_encoder,
        vae=reference.vae,
        scheduler=reference.scheduler,
        transformer=reference.transformer,
    )
    for index, prompt in enumerate(prompts):
        text, negative = text_pipe.encode_prompt(prompt, negative_prompt="", max_sequence_length=512)
        noise = torch.randn((4, 3, 2, 2), generator=torch.Generator().manual_seed(7 + index))[None]
        frames = reference(
            image=Image.open(image).convert("RGB"),
            prompt_embeds=text,
            negative_prompt_embeds=negative,
            latents=noise,
            height=16,
            width=16,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=3.0,
            output_type="pt",
        ).frames[0]
        theirs = _gif_frames(media.write_gif(tmp_path / f"theirs-{index}.gif", frames))
        ours = _gif_frames(out / f"{index:03d}-{prompt.replace(' ', '-')}.gif")
        assert ours.shape == (9, 16, 16, 3)
        np.testing.assert_array_equal(ours, theirs)
    # an I2V model needs an image; one image or one per prompt; a text-to-video model refuses one
    capsys.readouterr()
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(out), *flags[:-2], "--prompt", "x"]) == 2
    assert "give --image FILE" in capsys.readouterr().err
    twice = [*flags, "--image", str(image), "--image", str(image)]
    assert main(["generate", "--load-dir", str(pipe), "--output-dir", str(out), *twice, "--prompt", "x"]) == 2
    assert "--image given 3 times for 1 prompts" in capsys.readouterr().err
    t2v = write_demo_pipeline(tmp_path / "t2v")
    assert main(["generate", "--load-dir", str(t2v), "--output-dir", str(out), *FLAGS, "--image", str(image)]) == 2
    assert "generates from text only" in capsys.readouterr().err


def _pipeline_gif(tmp_path, name, pipe, prompt, seed, shape, **kwargs) -> np.ndarray:
    """The GIF frames of diffusers' ``pipe`` on ``prompt`` (encoded by ``WanPipeline.encode_prompt`` on its parts,
    empty negative prompt) from the seed noise our ``generate`` draws."""
    from diffusers import WanPipeline

    from mindspeed_mm.diffusion import media

    text_pipe = WanPipeline(
        tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler
    )
    text, negative = text_pipe.encode_prompt(prompt, negative_prompt="", max_sequence_length=512)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))[None]
    frames = pipe(
        prompt_embeds=text, negative_prompt_embeds=negative, latents=noise, output_type="pt", **kwargs
    ).frames[0]
    return _gif_frames(media.write_gif(tmp_path / f"{name}.gif", frames))


def test_generate_wan22_ti2v_and_flf2v_equal_pipelines(tmp_path, capsys) -> None:
    """``generate`` on a tiny Wan2.2 TI2V-5B pipeline (``expand_timesteps``, the Wan2.2 VAE) without ``--image``
    writes ``WanPipeline.from_pretrained``'s video, with ``--image`` ``WanImageToVideoPipeline.from_pretrained``'s
    (the same directory); ``generate --image A --last-image B`` on a tiny Wan2.1 FLF2V pipeline writes
    ``WanImageToVideoPipeline(image=A, last_image=B)``'s. A FLF2V model without ``--last-image``, or
    ``--last-image`` for another model: one-line errors."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from mindspeed_mm.testing.media_fixtures import tiny_i2v_parts, tiny_ti2v_parts, write_image

    rng = np.random.default_rng(5)
    first = write_image(tmp_path / "first.png", (rng.random((40, 70, 3)) * 255).astype(np.uint8))
    last = write_image(tmp_path / "last.png", (rng.random((40, 70, 3)) * 255).astype(np.uint8))
    prompt = "a red square moving left"
    steps = ["--num-inference-steps", "3", "--guidance-scale", "3", "--seed", "7", "--num-frames", "9", "--scale", "1"]
    ti2v = tmp_path / "ti2v"
    WanPipeline(**tiny_ti2v_parts(), expand_timesteps=True).save_pretrained(ti2v)
    flags = [*steps, "--height", "32", "--width", "64", "--prompt", prompt]
    video = {"height": 32, "width": 64, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 3.0}
    stem = f"000-{prompt.replace(' ', '-')}.gif"
    for name, extra, cls, kwargs in (
        ("t2v", [], WanPipeline, {}),
        ("i2v", ["--image", str(first)], WanImageToVideoPipeline, {"image": Image.open(first).convert("RGB")}),
    ):
        out = tmp_path / f"out-{name}"
        assert main(["generate", "--load-dir", str(ti2v), "--output-dir", str(out), *flags, *extra]) == 0
        reference = cls.from_pretrained(ti2v)
        assert reference.config.expand_timesteps
        theirs = _pipeline_gif(tmp_path, name, reference, prompt, 7, (48, 3, 2, 4), **video, **kwargs)
        ours = _gif_frames(out / stem)
        assert ours.shape == (9, 32, 64, 3)
        np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(_gif_frames(tmp_path / "out-t2v" / stem), _gif_frames(tmp_path / "out-i2v" / stem))

    flf2v = tmp_path / "flf2v"
    WanImageToVideoPipeline(**tiny_i2v_parts(flf2v=True)).save_pretrained(flf2v)
    flags = [*steps, "--height", "16", "--width", "16", "--prompt", prompt, "--image", str(first)]
    out = tmp_path / "out-flf2v"
    assert (
        main(["generate", "--load-dir", str(flf2v), "--output-dir", str(out), *flags, "--last-image", str(last)]) == 0
    )
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["image"] == str(first) and rows[0]["last_image"] == str(last)
    images = {"image": Image.open(first).convert("RGB"), "last_image": Image.open(last).convert("RGB")}
    video = {**video, "height": 16, "width": 16}
    reference = WanImageToVideoPipeline.from_pretrained(flf2v)
    theirs = _pipeline_gif(tmp_path, "flf2v", reference, prompt, 7, (4, 3, 2, 2), **video, **images)
    np.testing.assert_array_equal(_gif_frames(out / stem), theirs)
    capsys.readouterr()
    assert main(["generate", "--load-dir", str(flf2v), "--output-dir", str(out), *flags]) == 2
    assert "give --last-image FILE" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(ti2v),
                "--output-dir",
                str(out),
                *steps,
                "--prompt",
                "x",
                "--height",
                "32",
                "--width",
                "64",
                "--last-image",
                str(last),
            ]
        )
        == 2
    )
    assert "takes no last frame" in capsys.readouterr().err
