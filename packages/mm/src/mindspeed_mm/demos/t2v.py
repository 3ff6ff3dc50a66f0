"""The embedded text-to-video demo: coloured shapes moving in named directions, learnable in minutes on a CPU.

Each clip is :data:`NUM_FRAMES` frames of :data:`SIZE` x :data:`SIZE` pixels: one shape (square,
circle, triangle) in one colour (red, green, blue, yellow) on a dark background, moving left,
right, up or down by :data:`STEP` pixels a frame (since version 2: 4 frames, 4 pixels, so the clip
travels half the picture and its start on the motion's axis is nearly fixed; version 1 had 6 frames of
2 pixels); its caption says all three ("a red circle moving left"). Of the 48
combinations, :func:`heldout_combinations` keeps 8 out of training (each colour twice, each
direction twice): the learning check samples their captions and measures whether the dominant
colour and the motion of the samples match (:func:`score_videos`; chance 1/4 each).

The pipeline is written in code, once, into ``runs/mm-demo/t2v-v*/pipeline`` (diffusers layout):

- ``transformer``: a tiny ``WanTransformer3DModel`` (random initialisation; the recipe trains it);
- ``vae``: :class:`~mindspeed_mm.diffusion.patch_vae.PatchVAE`, a fixed lossless space-to-depth
  (why not a trained VAE: see its module);
- ``text_encoder`` / ``tokenizer``: a tiny random ``UMT5EncoderModel`` (frozen, as Wan's) over a
  word-level tokenizer of the captions' words;
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` (shift 1: the clips are small).

The feature cache of the training clips (``runs/mm-demo/t2v-v*/features``) is extracted with the
suite's encoders (:mod:`mindspeed_mm.models.encoders`). ``model.path: demo-t2v`` and
``data.features: demo-t2v`` in a recipe stand for them, ``--load-dir demo-t2v`` /
``--pipeline-dir demo-t2v`` / ``--prompts-file demo-t2v`` (the held-out captions) for ``generate``
(:mod:`mindspeed_mm.demos.names`).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from mindspeed.log import get_logger
from mindspeed_mm.demos import scene
from mindspeed_mm.demos.scene import COLOURS, DEFAULT_CACHE_DIR, SHAPES

logger = get_logger(__name__)

T2V = "demo-t2v"
BUILDER_VERSION = 3
SIZE, NUM_FRAMES, STEP = 24, 4, 4
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CLIPS_PER_COMBINATION = 12
TEXT_LEN = 8
#: The demo transformer: ~0.25 M parameters; 12 latent channels (3 colours x 2 x 2 pixels), 144 tokens a clip.
TINY_WAN = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,  # even: sequence-parallel sampling splits the heads over 2 ranks
    "attention_head_dim": 36,
    "in_channels": 12,
    "out_channels": 12,
    "text_dim": 32,
    "freq_dim": 64,
    "ffn_dim": 144,
    "num_layers": 3,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


def caption(colour: str, shape: str, direction: str) -> str:
    """The caption of a clip."""
    return f"a {colour} {shape} moving {direction}"


def heldout_combinations() -> list[tuple[str, str, str]]:
    """The 8 (colour, shape, direction) combinations never trained on: each colour and each direction twice."""
    return scene.heldout_triples(list(DIRECTIONS), shift=0)


def draw_clip(colour: str, shape: str, direction: str, rng: random.Random) -> np.ndarray:
    """``[F, H, W, 3]`` uint8: the shape at a random start and size, moving :data:`STEP` pixels a frame."""
    from PIL import Image, ImageDraw

    side = rng.randint(7, 9)
    travel = STEP * (NUM_FRAMES - 1)
    dx, dy = DIRECTIONS[direction]
    low_x, high_x = (travel, SIZE - side) if dx < 0 else (0, SIZE - side - travel) if dx > 0 else (0, SIZE - side)
    low_y, high_y = (travel, SIZE - side) if dy < 0 else (0, SIZE - side - travel) if dy > 0 else (0, SIZE - side)
    x, y = rng.randint(low_x, high_x), rng.randint(low_y, high_y)
    background = tuple(rng.randint(0, 40) for _ in range(3))
    frames = []
    for f in range(NUM_FRAMES):
        image = Image.new("RGB", (SIZE, SIZE), background)
        scene.draw_shape(ImageDraw.Draw(image), shape, colour, x + dx * STEP * f, y + dy * STEP * f, side)
        frames.append(np.asarray(image))
    return np.stack(frames)


def write_demo_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """Write the demo's untrained pipeline (see the module docstring) into ``directory``."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from mindspeed_mm.diffusion.patch_vae import PatchVAE

    directory = Path(directory)
    words = ["a", "moving", *COLOURS, *SHAPES, *DIRECTIONS]
    torch.manual_seed(seed)
    WanTransformer3DModel(**TINY_WAN).save_pretrained(str(directory / "transformer"))
    PatchVAE(patch_size=2).save_pretrained(str(directory / "vae"))
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(words) + 3,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    encoder.save_pretrained(str(directory / "text_encoder"))
    scene.word_tokenizer(words).save_pretrained(str(directory / "tokenizer"))
    scene.write_pipeline_index(directory, "WanPipeline", "WanTransformer3DModel", {"text_encoder": "UMT5EncoderModel"})
    return directory


def write_demo_features(pipeline: str | Path, directory: str | Path, seed: int = 0) -> Path:
    """Draw the training clips (every combination but the held-out ones) and cache their features."""
    from mindspeed_mm.data.features import write_features
    from mindspeed_mm.models.encoders import encode_umt5
    from mindspeed_mm.models.wan import WAN

    held = heldout_combinations()
    parts, latents, drawn = scene.encode_training_set(
        pipeline, WAN, DIRECTIONS, draw_clip, CLIPS_PER_COMBINATION, held, seed
    )
    captions = [caption(*c) for c in drawn]
    texts = encode_umt5(parts["tokenizer"], parts["text_encoder"], captions, TEXT_LEN)
    null = {"text": encode_umt5(parts["tokenizer"], parts["text_encoder"], [""], TEXT_LEN)[0]}
    samples = [{"latents": z, "text": t} for z, t in zip(latents, texts)]
    return write_features(directory, samples, captions, null)


def demo_paths(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build the demo pipeline, the training features and the held-out captions once (in ``cache_dir``).

    Returns:
        ``{"pipeline", "transformer", "features", "heldout"}``.
    """
    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"t2v-v{BUILDER_VERSION}"
    heldout = [caption(*c) for c in heldout_combinations()]
    return scene.build_demo(root, "text-to-video", write_demo_pipeline, write_demo_features, heldout, logger)


def score_videos(videos: torch.Tensor, captions: list[str]) -> dict[str, float]:
    """Share of ``videos`` (``[N, F, 3, H, W]`` in [0, 1]) whose dominant colour / motion matches the caption.

    The foreground is the pixels brighter than the background can be (max channel above 0.35); its
    mean colour's nearest palette colour is the video's colour; its centroid's displacement from
    the first to the last frame, along the larger axis, is its direction. No foreground: wrong.
    """
    directions = {v: k for k, v in DIRECTIONS.items()}
    right = {"colour": 0, "direction": 0}
    for video, text in zip(videos.float().cpu(), captions):
        words = text.split()
        mask = video.amax(dim=1) > 0.35  # [F, H, W]
        if mask.sum() == 0:
            continue
        mean = (video * mask[:, None]).sum(dim=(0, 2, 3)) / mask.sum()
        right["colour"] += scene.palette_name(mean) == words[1]
        ys, xs = torch.meshgrid(torch.arange(video.shape[-2]), torch.arange(video.shape[-1]), indexing="ij")
        centres = [((xs * m).sum() / m.sum(), (ys * m).sum() / m.sum()) for m in mask if m.sum() > 0]
        if len(centres) >= 2:
            dx, dy = float(centres[-1][0] - centres[0][0]), float(centres[-1][1] - centres[0][1])
            step = (int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))
            right["direction"] += directions.get(step) == words[-1]
    return {key: value / max(len(captions), 1) for key, value in right.items()}


def sample_heldout(
    load_dir: str | Path,
    seeds: int = 2,
    steps: int = 20,
    guidance_scale: float = 4.0,
    combinations: list[tuple[str, str, str]] | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """Videos ``[N, F, 3, H, W]`` in [0, 1] of the held-out captions (``seeds`` each, seeds 0, 1, ...) sampled from
    the transformer of ``load_dir`` (a directory or DCP checkpoint of the demo's model) with the demo's pipeline."""
    captions = [caption(*c) for c in (combinations or heldout_combinations()) for _ in range(seeds)]
    pipeline = demo_paths()["pipeline"]
    videos = scene.sample_captions(
        load_dir, pipeline, captions, seeds, (NUM_FRAMES, SIZE), TEXT_LEN, steps, guidance_scale
    )
    return videos, captions


@torch.no_grad()
def caption_losses(
    load_dir: str | Path, sigmas: tuple[float, ...] = (0.95, 0.8, 0.6, 0.4, 0.2), clips: int = 4, seed: int = 7
) -> dict[str, list[float]]:
    """Which caption words the transformer of ``load_dir`` uses: its flow-matching loss on fresh clips of the held-out
    combinations (``clips`` each, the same noise) at each of ``sigmas``, given their true caption, the caption with
    the opposite direction (``direction``), with the next colour (``colour``), and the empty caption (``empty``);
    and with the true caption on the clips with their frames shuffled (``shuffled``: frames 2, 0, 3, 1, which no
    steady motion makes).

    A word the model uses raises the loss when it is wrong; equal losses mean the model ignores it. A model
    that relates the frames by their motion predicts the shuffled clips worse.

    Returns:
        ``{"sigmas", "true", "direction", "colour", "empty", "shuffled"}``: the mean squared error to
        ``noise - x0`` per sigma.
    """
    from mindspeed_mm.inference.dit_pipeline import load_dit_pipeline
    from mindspeed_mm.models.encoders import encode_latents

    pipeline = demo_paths()["pipeline"]
    loaded = load_dit_pipeline(load_dir, base_dir=pipeline / "transformer", pipeline_dir=pipeline)
    family, model = loaded.family, loaded.model.eval()
    rng, colours = random.Random(seed), list(COLOURS)
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    drawn = [c for c in heldout_combinations() for _ in range(clips)]
    pixels = torch.from_numpy(np.stack([draw_clip(*c, rng) for c in drawn])).permute(0, 4, 1, 2, 3).float()
    latents = encode_latents(loaded.parts["vae"], pixels / 127.5 - 1)
    captions = {
        "true": [caption(c, s, d) for c, s, d in drawn],
        "direction": [caption(c, s, opposite[d]) for c, s, d in drawn],
        "colour": [caption(colours[(colours.index(c) + 1) % len(colours)], s, d) for c, s, d in drawn],
        "empty": [""] * len(drawn),
    }
    texts = {key: family.encode_prompts(loaded.parts, value, TEXT_LEN)[0] for key, value in captions.items()}
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(seed))
    shuffled = latents[:, :, [2, 0, 3, 1]]
    cases = {key: (latents, text) for key, text in texts.items()} | {"shuffled": (shuffled, texts["true"])}
    out: dict[str, list[float]] = {"sigmas": list(sigmas), **{key: [] for key in cases}}
    for sigma in sigmas:
        timestep = torch.full((len(drawn),), sigma)
        for key, (clean, text) in cases.items():
            noisy = (1 - sigma) * clean + sigma * noise
            inputs = family.model_inputs(model.config, noisy, timestep, text, None, 1.0)  # the training inputs
            velocity = family.prediction(model(**inputs), tuple(clean.shape))
            out[key].append(float(((velocity - (noise - clean)) ** 2).mean()))
    return out
