"""The embedded text-to-image demo: coloured shapes in named corners, learnable in minutes on a CPU.

Each image is :data:`SIZE` x :data:`SIZE` pixels: one shape (square, circle, triangle) in one colour
(red, green, blue, yellow) on a dark background, in one quadrant (top left, top right, bottom
left, bottom right) at a random offset and size; its caption says all three ("a red circle in the
top left"). Of the 48 combinations, :func:`heldout_combinations` keeps 8 out of training (each
colour twice, each position twice): the learning check samples their captions and measures
whether the dominant colour and the quadrant of the samples match (:func:`score_images`; chance 1/4
each).

The pipeline is written in code, once, into ``runs/mm-demo/t2i-v*/pipeline`` (diffusers'
``FluxPipeline`` layout):

- ``transformer``: a tiny ``FluxTransformer2DModel`` (random initialisation; the recipe trains it);
- ``vae``: :class:`~mindspeed_mm.diffusion.patch_vae.PatchVAE`, the fixed lossless space-to-depth
  of the text-to-video demo (why not a trained VAE: see its module);
- ``text_encoder`` / ``tokenizer``: a tiny random ``CLIPTextModel`` (its pooled output) and
  ``text_encoder_2`` / ``tokenizer_2``: a tiny random ``T5EncoderModel``, both frozen, over a
  word-level tokenizer of the captions' words;
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` (shift 1, no resolution-dependent shift: the
  images are small).

``model.path: demo-t2i`` and ``data.features: demo-t2i`` in a recipe stand for the transformer and
the feature cache of the training images; ``--load-dir`` / ``--pipeline-dir`` / ``--prompts-file
demo-t2i`` for ``generate`` (see :mod:`mindspeed_mm.demos.names`).
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from mindspeed.log import get_logger
from mindspeed_mm.demos.t2v import COLOURS, DEFAULT_CACHE_DIR, SHAPES, settle, word_tokenizer

logger = get_logger(__name__)

T2I = "demo-t2i"
BUILDER_VERSION = 1
SIZE = 32
#: quadrant name -> (column, row) of the quadrant.
POSITIONS = {"top left": (0, 0), "top right": (1, 0), "bottom left": (0, 1), "bottom right": (1, 1)}
IMAGES_PER_COMBINATION = 16
TEXT_LEN = 10
#: The demo transformer: ~0.2 M parameters; 48 input channels (12 PatchVAE channels packed 2 x 2), 64 tokens.
TINY_FLUX = {
    "patch_size": 1,
    "in_channels": 48,
    "out_channels": None,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": False,
    "axes_dims_rope": (4, 6, 6),
}


def caption(colour: str, shape: str, position: str) -> str:
    """The caption of an image."""
    return f"a {colour} {shape} in the {position}"


def heldout_combinations() -> list[tuple[str, str, str]]:
    """The 8 (colour, shape, position) combinations never trained on: each colour and each position twice."""
    colours, positions = list(COLOURS), list(POSITIONS)
    return [
        (c, SHAPES[(i + k) % len(SHAPES)], positions[(i + 2 * k + 1) % len(positions)])
        for i, c in enumerate(colours)
        for k in range(2)
    ]


def draw_image(colour: str, shape: str, position: str, rng: random.Random) -> np.ndarray:
    """``[H, W, 3]`` uint8: the shape at a random size and offset inside its quadrant."""
    from PIL import Image, ImageDraw

    half = SIZE // 2
    side = rng.randint(9, 13)
    column, row = POSITIONS[position]
    left = column * half + rng.randint(1, half - side - 1)
    top = row * half + rng.randint(1, half - side - 1)
    image = Image.new("RGB", (SIZE, SIZE), tuple(rng.randint(0, 40) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    box = (left, top, left + side - 1, top + side - 1)
    if shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    else:
        draw.polygon(
            [(left + side // 2, top), (left, top + side - 1), (left + side - 1, top + side - 1)], fill=COLOURS[colour]
        )
    return np.asarray(image)


def write_t2i_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """Write the demo's untrained pipeline (see the module docstring) into ``directory``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from mindspeed_mm.diffusion.patch_vae import PatchVAE

    directory = Path(directory)
    words = ["a", "in", "the", *COLOURS, *SHAPES, "top", "bottom", "left", "right"]
    torch.manual_seed(seed)
    FluxTransformer2DModel(**TINY_FLUX).save_pretrained(str(directory / "transformer"))
    PatchVAE(patch_size=2).save_pretrained(str(directory / "vae"))
    CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(words) + 3,
            hidden_size=TINY_FLUX["pooled_projection_dim"],
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=TEXT_LEN,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    ).save_pretrained(str(directory / "text_encoder"))
    T5EncoderModel(
        T5Config(
            vocab_size=len(words) + 3,
            d_model=TINY_FLUX["joint_attention_dim"],
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).save_pretrained(str(directory / "text_encoder_2"))
    for name in ("tokenizer", "tokenizer_2"):
        tokenizer = word_tokenizer(words)
        tokenizer.model_max_length = TEXT_LEN
        tokenizer.save_pretrained(str(directory / name))
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).save_pretrained(str(directory / "scheduler"))
    index = {
        "_class_name": "FluxPipeline",
        "_mindspeed_note": "the vae is mindspeed_mm's PatchVAE",
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["mindspeed_mm.diffusion.patch_vae", "PatchVAE"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (directory / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def write_t2i_features(pipeline: str | Path, directory: str | Path, seed: int = 0) -> Path:
    """Draw the training images (every combination but the held-out ones) and cache their features."""
    from mindspeed_mm.data.features import write_features
    from mindspeed_mm.inference.dit_pipeline import load_parts
    from mindspeed_mm.models.encoders import encode_latents
    from mindspeed_mm.models.flux import FLUX

    parts = load_parts(Path(pipeline), FLUX, torch.device("cpu"), torch.float32)
    held = set(heldout_combinations())
    rng = random.Random(seed)
    combinations = [c for c in itertools.product(COLOURS, SHAPES, POSITIONS) if c not in held]
    images = [(c, draw_image(*c, rng)) for c in combinations for _ in range(IMAGES_PER_COMBINATION)]
    pixels = torch.from_numpy(np.stack([image for _, image in images])).permute(0, 3, 1, 2).float() / 127.5 - 1
    latents = encode_latents(parts["vae"], pixels)
    captions = [caption(*c) for c, _ in images]
    text, pooled = FLUX.encode_prompts(parts, captions, TEXT_LEN)
    null_text, null_pooled = FLUX.encode_prompts(parts, [""], TEXT_LEN)
    samples = [{"latents": z, "text": t, "pooled": p} for z, t, p in zip(latents, text, pooled)]
    return write_features(directory, samples, captions, {"text": null_text[0], "pooled": null_pooled[0]})


def t2i_paths(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build the demo pipeline, the training features and the held-out captions once (in ``cache_dir``).

    Returns:
        ``{"pipeline", "transformer", "features", "heldout"}``.
    """
    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"t2i-v{BUILDER_VERSION}"
    paths = {
        "pipeline": root / "pipeline",
        "transformer": root / "pipeline" / "transformer",
        "features": root / "features",
        "heldout": root / "heldout.txt",
    }
    if not (paths["pipeline"] / "model_index.json").is_file():
        logger.info("writing the text-to-image demo pipeline into %s (once)", paths["pipeline"])
        tmp = root / "pipeline.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_t2i_pipeline(tmp)
        settle(tmp, paths["pipeline"], "model_index.json")
    if not (paths["features"] / "index.jsonl").is_file():
        logger.info("writing the text-to-image demo features into %s (once)", paths["features"])
        write_t2i_features(paths["pipeline"], paths["features"])
    if not paths["heldout"].is_file():
        paths["heldout"].write_text("".join(caption(*c) + "\n" for c in heldout_combinations()))
    return paths


def score_images(images: torch.Tensor, captions: list[str]) -> dict[str, float]:
    """Share of ``images`` (``[N, 3, H, W]`` in [0, 1]) whose dominant colour / quadrant matches the caption.

    The foreground is the pixels brighter than the background can be (max channel above 0.35); its
    mean colour's nearest palette colour is the image's colour, the quadrant of its centroid the
    image's position. No foreground: wrong.
    """
    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32) / 255
    names, quadrants = list(COLOURS), {v: k for k, v in POSITIONS.items()}
    right = {"colour": 0, "position": 0}
    for image, text in zip(images.float().cpu(), captions):
        mask = image.amax(dim=0) > 0.35  # [H, W]
        if mask.sum() == 0:
            continue
        mean = (image * mask).sum(dim=(1, 2)) / mask.sum()
        right["colour"] += names[int(torch.cdist(mean[None], palette).argmin())] == text.split()[1]
        ys, xs = torch.meshgrid(torch.arange(image.shape[-2]), torch.arange(image.shape[-1]), indexing="ij")
        x, y = float((xs * mask).sum() / mask.sum()), float((ys * mask).sum() / mask.sum())
        quadrant = (int(x >= image.shape[-1] / 2), int(y >= image.shape[-2] / 2))
        right["position"] += text.endswith(quadrants[quadrant])
    return {key: value / max(len(captions), 1) for key, value in right.items()}


def sample_t2i_heldout(
    load_dir: str | Path, seeds: int = 2, steps: int = 20, guidance_scale: float = 4.0
) -> tuple[torch.Tensor, list[str]]:
    """Images ``[N, 3, H, W]`` in [0, 1] of the held-out captions (``seeds`` each, seeds 0, 1, ...) sampled from
    the transformer of ``load_dir`` (a directory or DCP checkpoint of the demo's model) with the demo's pipeline."""
    from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline

    pipeline = t2i_paths()["pipeline"]
    loaded = load_dit_pipeline(load_dir, base_dir=pipeline / "transformer", pipeline_dir=pipeline)
    family = loaded.family
    captions = [caption(*c) for c in heldout_combinations() for _ in range(seeds)]
    shape = latent_shape(loaded.parts["vae"], family, 1, SIZE, SIZE)
    noise = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(i % seeds)) for i in range(len(captions))]
    )
    text, pooled = family.encode_prompts(loaded.parts, captions, TEXT_LEN)
    negative, negative_pooled = family.encode_prompts(loaded.parts, [""], TEXT_LEN)
    latents = sample_latents(
        loaded.model,
        family,
        build_scheduler(family, pipeline),
        noise,
        text,
        steps,
        pooled,
        negative.expand(len(captions), -1, -1),
        negative_pooled.expand(len(captions), -1),
        guidance_scale,
    )
    return decode_latents(loaded.parts["vae"], latents), captions
