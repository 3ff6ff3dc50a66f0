"""The embedded image-to-video demo: a given first frame (a coloured shape) moved the way the caption says.

Each clip is :data:`NUM_FRAMES` frames of :data:`SIZE` x :data:`SIZE` pixels: one shape (square, circle,
triangle) in one colour (red, green, blue, yellow) on a dark background, moving left, right, up or down by
:data:`STEP` pixels a frame from a start drawn where every direction fits (so the start says nothing about
the direction). Its first frame is the condition (as ``WanImageToVideoPipeline`` takes an image), its caption
names the motion only ("moving left"): the colour and the shape come from the image alone. Of the 48
(colour, shape, direction) combinations, :func:`heldout_combinations` keeps 8 out of training (each colour
twice, each direction twice); the learning check draws fresh first frames of them (:func:`heldout_first_frames`),
samples their clips, and measures whether the frames after the first keep the first frame's colour and whether
the shape moves the caption's way (:func:`score_clips`; chance 1/4 each).

The pipeline is written in code, once, into ``runs/mm-demo/i2v-v*/pipeline`` (``WanImageToVideoPipeline``
layout, in the Wan2.2 I2V configuration: no image encoder):

- ``transformer``: a tiny ``WanTransformer3DModel`` in its I2V configuration (input: the noisy latents, the
  first-frame mask and the first frame's latents on channels; random initialisation, the recipe trains it);
- ``vae``: :class:`~mindspeed_mm.diffusion.patch_vae.PatchVAE`, the demos' fixed lossless space-to-depth (no
  time stride: one mask channel, each frame its own latent frame);
- ``text_encoder`` / ``tokenizer``: a tiny random ``UMT5EncoderModel`` (frozen) over a word-level tokenizer;
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` (shift 1).

Why not the Wan2.1 I2V configuration (a CLIP vision encoder's features in the cross-attention): its attention
reads the last 512 context tokens as the text, so every step pays for 512 text tokens; the demo's steps cost
about 3 times more for it, and the budget's steps learned less (docs/mm/dit.md).

The training features (``runs/mm-demo/i2v-v*/features``) hold each clip's latents, caption embedding and the
first-frame conditions computed by the family's ``image_conditions`` from the clip's first frame as an 8-bit
image, exactly as ``extract-features`` computes them (:class:`~mindspeed_mm.data.media_features.MediaFeatures`).
``model.path: demo-i2v`` and ``data.features: demo-i2v`` in a recipe stand for them; ``--pipeline-dir demo-i2v``
and ``--prompts-file demo-i2v`` (the held-out captions) for ``generate``, whose ``--image`` files are the
held-out first frames written beside them (``heldout/*.png``, in the captions' order).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mindspeed.log import get_logger
from mindspeed_mm.demos import scene
from mindspeed_mm.demos.scene import COLOURS, DEFAULT_CACHE_DIR, SHAPES

logger = get_logger(__name__)

I2V = "demo-i2v"
BUILDER_VERSION = 1
SIZE, NUM_FRAMES, STEP = 16, 2, 4
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CLIPS_PER_COMBINATION = 12
TEXT_LEN = 8
HELDOUT_SEED = 99
#: The demo transformer: 12 PatchVAE channels, 1 mask channel (the VAE has no time stride) and the first
#: frame's 12 in; 32 tokens a clip (2 frames of 4 x 4 tokens); 0.19 M parameters.
TINY_WAN_I2V = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 18,
    "in_channels": 25,
    "out_channels": 12,
    "text_dim": 32,
    "freq_dim": 64,
    "ffn_dim": 144,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


def caption(direction: str) -> str:
    """The caption of a clip: its motion only (the colour and the shape are the first frame's)."""
    return f"moving {direction}"


def heldout_combinations() -> list[tuple[str, str, str]]:
    """The 8 (colour, shape, direction) combinations never trained on: each colour and each direction twice."""
    return scene.heldout_triples(list(DIRECTIONS), shift=2)


def draw_clip(colour: str, shape: str, direction: str, rng: random.Random) -> np.ndarray:
    """``[F, H, W, 3]`` uint8: the shape at a random size and start from which every direction fits, moving
    :data:`STEP` pixels a frame ``direction``'s way."""
    from PIL import Image, ImageDraw

    side = rng.randint(6, 7)
    travel = STEP * (NUM_FRAMES - 1)
    x, y = rng.randint(travel, SIZE - side - travel), rng.randint(travel, SIZE - side - travel)
    dx, dy = DIRECTIONS[direction]
    background = tuple(rng.randint(0, 40) for _ in range(3))
    frames = []
    for f in range(NUM_FRAMES):
        image = Image.new("RGB", (SIZE, SIZE), background)
        scene.draw_shape(ImageDraw.Draw(image), shape, colour, x + dx * STEP * f, y + dy * STEP * f, side)
        frames.append(np.asarray(image))
    return np.stack(frames)


def write_i2v_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """Write the demo's untrained pipeline (see the module docstring) into ``directory``."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from mindspeed_mm.diffusion.patch_vae import PatchVAE

    directory = Path(directory)
    words = ["moving", *DIRECTIONS]
    torch.manual_seed(seed)
    WanTransformer3DModel(**TINY_WAN_I2V).save_pretrained(str(directory / "transformer"))
    PatchVAE(patch_size=2).save_pretrained(str(directory / "vae"))
    UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(words) + 3,
            d_model=TINY_WAN_I2V["text_dim"],
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).save_pretrained(str(directory / "text_encoder"))
    scene.word_tokenizer(words).save_pretrained(str(directory / "tokenizer"))
    scene.write_pipeline_index(
        directory, "WanImageToVideoPipeline", "WanTransformer3DModel", {"text_encoder": "UMT5EncoderModel"}
    )
    return directory


def first_frame_conditions(parts: dict[str, Any], frames: np.ndarray) -> dict[str, torch.Tensor]:
    """The I2V conditions of a clip ``[F, H, W, 3]`` uint8: its first frame through the family's
    ``image_conditions``, as ``extract-features`` and ``generate --image`` compute them."""
    from PIL import Image

    from mindspeed_mm.models.wan_i2v import WAN_I2V

    conditions = WAN_I2V.image_conditions(parts, Image.fromarray(frames[0]), NUM_FRAMES, SIZE, SIZE)
    return {key: value.float().cpu() for key, value in conditions.items()}


def write_i2v_features(pipeline: str | Path, directory: str | Path, seed: int = 0) -> Path:
    """Draw the training clips (every combination but the held-out ones) and cache their features."""
    from mindspeed_mm.data.features import write_features
    from mindspeed_mm.inference.dit_pipeline import load_parts
    from mindspeed_mm.models.encoders import encode_latents, encode_umt5
    from mindspeed_mm.models.wan_i2v import WAN_I2V

    parts = load_parts(Path(pipeline), WAN_I2V, torch.device("cpu"), torch.float32)
    rng, held = random.Random(seed), set(heldout_combinations())
    combinations = [(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS if (c, s, d) not in held]
    drawn = [(c, draw_clip(*c, rng)) for c in combinations for _ in range(CLIPS_PER_COMBINATION)]
    pixels = torch.from_numpy(np.stack([clip for _, clip in drawn])).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    latents = encode_latents(parts["vae"], pixels)
    captions = [caption(c[2]) for c, _ in drawn]
    texts = encode_umt5(parts["tokenizer"], parts["text_encoder"], captions, TEXT_LEN)
    null = {"text": encode_umt5(parts["tokenizer"], parts["text_encoder"], [""], TEXT_LEN)[0]}
    samples = [
        {"latents": z, "text": t, **first_frame_conditions(parts, clip)}
        for z, t, (_, clip) in zip(latents, texts, drawn)
    ]
    return write_features(directory, samples, captions, null)


def heldout_first_frames(seeds: int = 1) -> list[tuple[tuple[str, str, str], np.ndarray]]:
    """Fresh clips of the held-out combinations (``seeds`` each, drawn from one generator seeded
    :data:`HELDOUT_SEED`): ``[(combination, clip [F, H, W, 3] uint8)]``, the combinations in order."""
    rng = random.Random(HELDOUT_SEED)
    return [(c, draw_clip(*c, rng)) for c in heldout_combinations() for _ in range(seeds)]


def i2v_paths(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build the demo pipeline, the training features, the held-out captions and their first frames once.

    Returns:
        ``{"pipeline", "transformer", "features", "heldout", "images"}``: ``images`` is the folder of the held-out
        first frames, ``NNN.png`` in the order of the captions in ``heldout``.
    """
    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"i2v-v{BUILDER_VERSION}"
    held = heldout_first_frames()
    captions = [caption(c[2]) for c, _ in held]
    paths = scene.build_demo(root, "image-to-video", write_i2v_pipeline, write_i2v_features, captions, logger)
    paths["images"] = root / "heldout"
    if not (paths["images"] / f"{len(held) - 1:03d}.png").is_file():
        from PIL import Image

        tmp = root / "heldout.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        for i, (_, clip) in enumerate(held):
            Image.fromarray(clip[0]).save(tmp / f"{i:03d}.png")
        scene.settle(tmp, paths["images"], f"{len(held) - 1:03d}.png")
    return paths


def heldout_images(cache_dir: str | Path | None = None) -> list[Path]:
    """The held-out first frames (``generate --image`` files, in the order of ``--prompts-file demo-i2v``)."""
    return sorted(i2v_paths(cache_dir)["images"].glob("*.png"))


def _foreground(frame: torch.Tensor) -> torch.Tensor:
    return frame.amax(dim=0) > 0.35  # [H, W]: brighter than any background


def _centroid(mask: torch.Tensor) -> tuple[float, float]:
    """``(x, y)`` of the mean pixel of ``mask`` ``[H, W]`` (not empty)."""
    ys, xs = torch.meshgrid(torch.arange(mask.shape[0]), torch.arange(mask.shape[1]), indexing="ij")
    return float((xs * mask).sum() / mask.sum()), float((ys * mask).sum() / mask.sum())


def score_clips(
    clips: torch.Tensor, firsts: list[np.ndarray], captions: list[str], colours: list[str]
) -> dict[str, float]:
    """Share of ``clips`` (``[N, F, 3, H, W]`` in [0, 1]) that keep their first frame's colour and move the caption's way.

    The foreground is the pixels brighter than the background can be (max channel above 0.35). Colour: the
    palette colour nearest to the foreground's mean over the frames after the first (the first frame is given) is
    ``colours[i]``. Direction: the centroid of the last frame's foreground moved from that of the given first frame
    ``firsts[i]`` (``[H, W, 3]`` uint8) along the caption's axis, by more than along the other axis, the caption's
    way. No foreground: wrong.
    """
    right = {"colour": 0, "direction": 0}
    for clip, first, text, colour in zip(clips.float().cpu(), firsts, captions, colours):
        later = clip[1:]
        mask = torch.stack([_foreground(f) for f in later])
        if mask.sum() == 0:
            continue
        mean = (later * mask[:, None]).sum(dim=(0, 2, 3)) / mask.sum()
        right["colour"] += scene.palette_name(mean) == colour
        start = _foreground(torch.from_numpy(first).permute(2, 0, 1).float() / 255)
        end = _foreground(clip[-1])
        if end.sum() == 0:
            continue
        (x0, y0), (x1, y1) = _centroid(start), _centroid(end)
        dx, dy = DIRECTIONS[text.split()[-1]]
        along = (x1 - x0) * dx + (y1 - y0) * dy
        across = abs((x1 - x0) * dy) + abs((y1 - y0) * dx)
        right["direction"] += along > across
    return {key: value / max(len(captions), 1) for key, value in right.items()}


@torch.no_grad()
def sample_i2v_heldout(
    load_dir: str | Path, seeds: int = 2, steps: int = 10, guidance_scale: float = 4.0
) -> dict[str, float]:
    """Sample the held-out clips from the transformer of ``load_dir`` (a directory or DCP checkpoint of the demo's
    model) with the demo's pipeline: each held-out combination's first frame with its caption, from ``seeds``
    noises (seeds 0, 1, ...), and score them (:func:`score_clips`).

    Returns:
        ``{"colour", "direction"}``.
    """
    from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline

    pipeline = i2v_paths()["pipeline"]
    loaded = load_dit_pipeline(load_dir, base_dir=pipeline / "transformer", pipeline_dir=pipeline)
    family = loaded.family
    held = [item for item in heldout_first_frames() for _ in range(seeds)]
    captions = [caption(c[2]) for c, _ in held]
    shape = latent_shape(loaded.parts["vae"], family, NUM_FRAMES, SIZE, SIZE)
    noise = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(i % seeds)) for i in range(len(held))]
    )
    per_clip = [first_frame_conditions(loaded.parts, clip) for _, clip in held]
    conditions = {key: torch.stack([c[key] for c in per_clip]) for key in per_clip[0]}
    text, _ = family.encode_prompts(loaded.parts, captions, TEXT_LEN)
    negative, _ = family.encode_prompts(loaded.parts, [""], TEXT_LEN)
    latents = sample_latents(
        loaded.model,
        family,
        build_scheduler(family, pipeline),
        noise,
        text,
        steps,
        None,
        negative.expand(len(held), -1, -1),
        None,
        guidance_scale,
        conditions=conditions,
    )
    clips = decode_latents(loaded.parts["vae"], latents)
    return score_clips(clips, [clip[0] for _, clip in held], captions, [c[0] for c, _ in held])
