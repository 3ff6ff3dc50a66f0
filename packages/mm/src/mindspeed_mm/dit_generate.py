"""``mindspeed-mm generate`` for diffusion transformers: text (and image) to video (Wan) or image (FLUX) files.

``generate_cli.run_generate`` hands over here when ``--load-dir`` (or ``--base-dir``) is a
diffusers model (:func:`~mindspeed_mm.inference.dit_pipeline.is_dit_source`). Each prompt is encoded
with the pipeline's text encoder(s) as the pipeline encodes it, starts from noise drawn with
``seed + its index``, is denoised by :func:`~mindspeed_mm.diffusion.sampler.sample_latents`
(Euler or UniPC, classifier-free guidance against the negative prompt) and decoded by the
pipeline's VAE. With sequence-parallel sampling (``--ulysses-parallel-size`` x ``--ring-attention-size``
ranks) every rank holds each prompt's latents; the ranks then decode a share of the prompts each
(:func:`~mindspeed_mm.diffusion.sampler.decode_shared`) and rank 0 writes. ``--output-dir`` receives ``NNN-<words>.png`` per image or ``.gif`` (and ``.mp4``
where PyAV is installed) per video, ``contact_sheet.png`` (and ``contact_sheet.gif`` for videos)
of all prompts, and ``samples.jsonl`` (prompt, seed, settings, files).

An image-to-video model (Wan I2V: a family with ``image_conditions``) takes ``--image FILE``: one image for
every prompt, or one per prompt in order; it is the video's first frame, conditioned on as
``WanImageToVideoPipeline`` does (resized to ``--height`` x ``--width``). A first-last-frame model (Wan
FLF2V) takes ``--last-image FILE`` too; Wan2.2 TI2V-5B generates from text alone or, with ``--image``,
from text and its first frame. An image-editing model (Qwen-Image-Edit) takes ``--image SRC``, the image
to edit: each prompt and the negative prompt are encoded with it, and its latents condition every step, as
``QwenImageEditPipeline`` does.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True)
class DiTSampleConfig:
    """The ``generate`` options of diffusion transformers (besides ``--load-dir``, ``--base-dir``, ``--prompt``,
    ``--prompts-file``, ``--max-samples``, ``--seed``, ``--dtype`` and ``--batch-size``).

    Attributes:
        pipeline_dir: diffusers pipeline directory whose VAE, text encoder(s), tokenizer(s) and scheduler are
            used (default: --load-dir when it is one, else the transformer directory's parent when that is one;
            demo-t2v / demo-t2i for the demos).
        output_dir: where the pictures, videos, contact sheets and samples.jsonl go.
        negative_prompt: what classifier-free guidance steers away from (default: the empty prompt).
        sampler: euler or unipc (diffusers' flow-matching schedulers; default: the pipeline's scheduler, else the
            model family's: UniPC for Wan, Euler for FLUX).
        num_inference_steps: denoising steps.
        guidance_scale: classifier-free guidance scale (1: none; Wan's guidance_scale, FLUX's true_cfg_scale;
            default 5 for video, 1 for images).
        guidance_scale_2: Wan2.2 (a pipeline with ``transformer_2`` and ``boundary_ratio``): the guidance of the
            low-noise expert's steps (default: guidance_scale), as ``WanPipeline``'s ``guidance_scale_2``.
        distilled_guidance: the guidance value a guidance-distilled model (FLUX.1-dev) is given.
        flow_shift: a fixed shift of the sampling sigmas (default: the scheduler's).
        height: pixels (default: 480 for video, 1024 for images).
        width: pixels (default: 832 for video, 1024 for images).
        num_frames: frames of a video (frames - 1 a multiple of the VAE's temporal stride).
        text_len: text embeddings padded to this many tokens, as the model was trained (data.text_len).
        fps: frames per second of the written videos.
        scale: enlarge the written pictures this many times (nearest neighbour; for tiny models).
        ulysses_parallel_size: ranks that sample each prompt together, each holding a share of the video /
            image tokens (Ulysses sequence parallelism, as the training key ``parallel.ulysses_parallel_size``;
            spawned here, or the world size under torchrun); the heads must divide by it.
        ring_attention_size: the ring degree (as ``parallel.ring_attention_size``): the sampling group is
            ``ulysses_parallel_size x ring_attention_size`` ranks, Ulysses inside groups of
            ``ulysses_parallel_size`` consecutive ranks and ring attention across them (USP); under torchrun
            the Ulysses degree is the world size over it.
        skip_guidance_layers: skip-layer guidance (SD3 / SD3.5, as StableDiffusion3Pipeline's
            skip_guidance_layers): comma-separated indices of the blocks skipped in one more prediction per step,
            e.g. 7,8,9 (SD3.5 Medium's recommendation); needs --guidance-scale above 1.
        skip_layer_guidance_scale: the scale of the skipped-layer guidance.
        skip_layer_guidance_start: the fraction of the steps after which skip-layer guidance applies.
        skip_layer_guidance_stop: the fraction of the steps before which skip-layer guidance applies.
        clip_skip: SD3 / SD3.5: the prompts' CLIP features from this many layers before the penultimate, as
            StableDiffusion3Pipeline's clip_skip (the negative prompt's stay the penultimate's, as there).
        ema: a training checkpoint of a train.ema run samples with the moving averages of its weights (the
            default); --no-ema: with its raw trained weights.
    """

    pipeline_dir: str | None = None
    output_dir: str = "samples"
    negative_prompt: str = ""
    sampler: str | None = None
    num_inference_steps: int = 50
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    distilled_guidance: float = 3.5
    flow_shift: float | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int = 81
    text_len: int | None = None
    fps: int = 16
    scale: int = 1
    ulysses_parallel_size: int = 1
    ring_attention_size: int = 1
    skip_guidance_layers: str | None = None
    skip_layer_guidance_scale: float = 2.8
    skip_layer_guidance_start: float = 0.01
    skip_layer_guidance_stop: float = 0.2
    clip_skip: int | None = None
    ema: bool = True


def skip_layer_guidance(sample: DiTSampleConfig) -> Any:
    """The :class:`~mindspeed_mm.diffusion.sampler.SkipLayerGuidance` of the ``--skip-*`` flags; None without
    ``--skip-guidance-layers``.

    Raises:
        ValueError: indices that are not integers.
    """
    if sample.skip_guidance_layers is None:
        return None
    from mindspeed_mm.diffusion.sampler import SkipLayerGuidance

    text = sample.skip_guidance_layers
    try:
        layers = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--skip-guidance-layers {text!r}: give comma-separated block indices, e.g. 7,8,9") from None
    return SkipLayerGuidance(
        layers, sample.skip_layer_guidance_scale, sample.skip_layer_guidance_start, sample.skip_layer_guidance_stop
    )


def read_prompts(path: str, max_samples: int | None) -> list[str]:
    """Prompts of a ``.txt`` file (one a line) or a ``.json`` / ``.jsonl`` file (``cap`` or ``caption`` of each
    entry, MindSpeed-MM's data.json); ``demo-t2v`` / ``demo-t2i``: the demo's held-out captions.

    Raises:
        ValueError: a missing file, or an entry without ``cap`` / ``caption`` (naming the line).
    """
    from mindspeed_mm.demos.names import resolve_prompts_file

    file = resolve_prompts_file(path)
    if not file.is_file():
        raise ValueError(
            f"--prompts-file {path!r} does not exist; give a .txt (one prompt a line) or .json/.jsonl file"
        )
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".txt":
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        entries = (
            json.loads(text) if file.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
        prompts = []
        for number, entry in enumerate(entries, 1):
            value = entry.get("cap", entry.get("caption")) if isinstance(entry, dict) else None
            if isinstance(value, list):
                value = value[0] if value else None
            if not isinstance(value, str):
                raise ValueError(f"{file}: entry {number} has no `cap` or `caption` text; add one")
            prompts.append(value)
    return prompts[:max_samples] if max_samples is not None else prompts


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48] or "prompt"


def run_dit_generate(args: Any, sample: DiTSampleConfig) -> int:
    """Sample every prompt and write the files (see the module docstring); returns the exit status."""
    from mindspeed_mm.inference.loading import DTYPES  # lazy: keeps torch out of the start-up of mindspeed_mm.cli

    prompts = list(args.prompt) + (read_prompts(args.prompts_file, args.max_samples) if args.prompts_file else [])
    if not prompts:
        raise ValueError("nothing to generate: give --prompt TEXT or --prompts-file FILE")
    for flag, given in (("--image", args.image), ("--last-image", getattr(args, "last_image", []))):
        if given and len(given) not in (1, len(prompts)):
            raise ValueError(
                f"{flag} given {len(given)} times for {len(prompts)} prompts; give one image for every prompt or "
                "one per prompt"
            )
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    for key in ("num_inference_steps", "num_frames", "fps", "scale", "ulysses_parallel_size", "ring_attention_size"):
        if getattr(sample, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} {getattr(sample, key)} must be at least 1")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be at least 1")
    skip_layer_guidance(sample)  # malformed indices fail before loading anything
    ranks = sample.ulysses_parallel_size * sample.ring_attention_size
    if ranks > 1:
        from mindspeed.launch import launch

        return launch(_sample_all, (args, sample, prompts), nproc_per_node=ranks) or 0
    return _sample_all(args, sample, prompts)


def _sample_all(args: Any, sample: DiTSampleConfig, prompts: list[str]) -> int:
    """Sample and write on this process (one rank of a sequence-parallel group: the ranks decode a share of the
    prompts each, rank 0 writes)."""
    import torch  # lazy: keeps torch out of the start-up of mindspeed_mm.cli
    import torch.distributed as dist

    from mindspeed_mm.diffusion import media
    from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, decode_shared, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline, load_second_expert
    from mindspeed_mm.inference.loading import DTYPES
    from mindspeed_mm.models.dit_parallel import apply_sequence_parallel

    loaded = load_dit_pipeline(
        args.load_dir,
        args.base_dir,
        sample.pipeline_dir,
        DTYPES[args.dtype or "float32"],
        ema=sample.ema,
        lora_alpha=getattr(args, "lora_alpha", None),
    )
    if not loaded.parts:
        raise ValueError(f"{loaded.weights} has no pipeline beside it (VAE, text encoder); pass --pipeline-dir")
    family, video = loaded.family, loaded.family.latent_dims == 4
    model_2, boundary_ratio = load_second_expert(loaded, DTYPES[args.dtype or "float32"])
    if sample.guidance_scale_2 is not None and model_2 is None:
        raise ValueError(
            "--guidance-scale-2 applies to a Wan2.2 pipeline (transformer_2 and boundary_ratio in its "
            "model_index.json) given as --load-dir; remove it"
        )
    if family.encode_prompts is None:
        raise ValueError(f"{family.architecture}: the suite cannot encode prompts for it yet")
    options = {"clip_skip": sample.clip_skip} if sample.clip_skip is not None else {}
    if any(key not in family.encode_options for key in options):
        raise ValueError(f"--clip-skip: {family.key}'s prompts take no clip_skip (SD3's do); remove --clip-skip")
    images = _read_images(args.image, family, len(prompts))
    last_paths = getattr(args, "last_image", [])
    if bool(last_paths) != family.last_frame:
        raise ValueError(
            f"{family.key} takes the last frame: give --last-image FILE"
            if family.last_frame
            else f"--last-image: {family.key} takes no last frame (a Wan FLF2V model does); remove --last-image"
        )
    last_images = _read_images(last_paths, family, len(prompts)) if last_paths else []
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        if family.sequence_plan is None:
            raise ValueError(f"{family.architecture} has no sequence-parallel plan; use --ulysses-parallel-size 1")
        world, ring = dist.get_world_size(), sample.ring_attention_size
        if world % ring:
            raise ValueError(f"--ring-attention-size {ring} does not divide the {world} ranks; use a divisor")
        ulysses = world // ring
        algo = "ulysses_cp_algo" if ring == 1 else "megatron_cp_algo" if ulysses == 1 else "hybrid_cp_algo"
        group = dist.group.WORLD
        apply_sequence_parallel(loaded.model, family.sequence_plan, group, algo, ulysses)
        if model_2 is not None:
            apply_sequence_parallel(model_2, family.sequence_plan, group, algo, ulysses)
    writer = group is None or dist.get_rank() == 0
    height = sample.height or (480 if video else 1024)
    width = sample.width or (832 if video else 1024)
    shape = latent_shape(loaded.parts["vae"], family, sample.num_frames, height, width)
    guidance = sample.guidance_scale if sample.guidance_scale is not None else (5.0 if video else 1.0)
    text_len = sample.text_len or family.text_len
    seed = args.seed if args.seed is not None else 0
    output = Path(sample.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    negative = None
    if guidance > 1 and not family.image_prompts:
        negative = family.encode_prompts(loaded.parts, [sample.negative_prompt], text_len)
    sampled = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        # Qwen-Image-Edit: each prompt (and the negative prompt) is encoded with its source image
        with_images = {"images": images[start : start + len(batch)]} if family.image_prompts else {}
        text, pooled = family.encode_prompts(loaded.parts, batch, text_len, **options, **with_images)
        if guidance > 1 and family.image_prompts:
            negative = family.encode_prompts(
                loaded.parts, [sample.negative_prompt] * len(batch), text_len, **with_images
            )
        noise = torch.stack(
            [torch.randn(shape, generator=torch.Generator().manual_seed(seed + start + i)) for i in range(len(batch))]
        ).to(loaded.device)
        scheduler = build_scheduler(family, loaded.pipeline_dir, sample.sampler, sample.flow_shift)
        neg_text = negative[0].expand(len(batch), -1, -1) if negative is not None else None
        neg_pooled = negative[1].expand(len(batch), -1) if negative is not None and negative[1] is not None else None
        conditions = None
        if images:
            per_prompt = [
                family.image_conditions(
                    loaded.parts,
                    images[start + i],
                    sample.num_frames,
                    height,
                    width,
                    **({"last_image": last_images[start + i]} if last_images else {}),
                )
                for i in range(len(batch))
            ]
            conditions = {key: torch.stack([c[key] for c in per_prompt]) for key in per_prompt[0]}
        latents = sample_latents(
            loaded.model,
            family,
            scheduler,
            noise,
            text,
            sample.num_inference_steps,
            pooled,
            neg_text,
            neg_pooled,
            guidance,
            sample.distilled_guidance,
            model_2,
            boundary_ratio,
            sample.guidance_scale_2,
            conditions,
            skip_layer_guidance(sample),
        )
        sampled.append(latents)
    if group is None:  # one batch at a time, as sampled
        decoded = torch.cat([decode_latents(loaded.parts["vae"], z).float().cpu() for z in sampled])
    else:  # every rank holds the whole latents: each decodes a share of the prompts, rank 0 writes
        decoded = decode_shared(loaded.parts["vae"], torch.cat(sampled), group)
    if not writer:
        return 0
    pixels_all, rows = list(decoded.float().cpu()), []
    for index, (prompt, item) in enumerate(zip(prompts, pixels_all)):
        files = _write_sample(output / f"{index:03d}-{_slug(prompt)}", item, sample, media)
        row = {"index": index, "prompt": prompt, "seed": seed + index, "files": [str(f) for f in files]}
        if args.image:
            row["image"] = args.image[index if len(args.image) > 1 else 0]
        if last_paths:
            row["last_image"] = last_paths[index if len(last_paths) > 1 else 0]
        rows.append(row)
    sheets = media.write_contact_sheets(output, pixels_all, prompts, sample.fps, sample.scale)
    settings = {
        **asdict(sample),
        "guidance_scale": guidance,
        "boundary_ratio": boundary_ratio,
        "height": height,
        "width": width,
        "text_len": text_len,
        "scheduler": type(scheduler).__name__,
        "weights": str(loaded.weights),
    }
    _write_jsonl(output / "samples.jsonl", [{**row, "settings": settings} for row in rows])
    logger.info(
        "generate: %d %s in %.2f s into %s (%s)",
        len(prompts),
        "videos" if video else "images",
        time.perf_counter() - started,
        output,
        ", ".join(p.name for p in sheets),
    )
    return 0


def _read_images(paths: list[str], family: Any, count: int) -> list[Any]:
    """The ``count`` prompts' input images (RGB PIL images), or none for a text-only model (and for Wan2.2
    TI2V without ``--image``: text to video).

    Raises:
        ValueError: an image for a model that takes none, none for an image-to-video model, or a file that is
            not an image.
    """
    if family.image_conditions is None:
        if paths:
            raise ValueError(f"--image: {family.key} generates from text only; remove --image")
        return []
    if not paths:
        if family.first_frame_condition:  # Wan2.2 TI2V: text-to-video without an image
            return []
        if family.image_prompts:
            raise ValueError(f"{family.key} is an image-editing model: give --image SRC (the image to edit)")
        raise ValueError(f"{family.key} is an image-to-video model: give --image FILE (the first frame)")
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as error:
            raise ValueError(f"--image {path!r} is not a readable image ({error}); give a PNG or JPEG file") from None
    return images * count if len(images) == 1 else images


def _write_sample(stem: Path, pixels: Any, sample: DiTSampleConfig, media: Any) -> list[Path]:
    import torch

    if pixels.ndim == 3:
        image = pixels
        if sample.scale > 1:
            image = torch.nn.functional.interpolate(image[None], scale_factor=sample.scale, mode="nearest")[0]
        return [media.write_png(stem.with_suffix(".png"), image)]
    files = [media.write_gif(stem.with_suffix(".gif"), pixels, sample.fps, sample.scale)]
    if media.mp4_available():
        frames = pixels
        if sample.scale > 1:
            frames = torch.nn.functional.interpolate(frames, scale_factor=sample.scale, mode="nearest")
        files.append(media.write_mp4(stem.with_suffix(".mp4"), frames, sample.fps))
    return files


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)
