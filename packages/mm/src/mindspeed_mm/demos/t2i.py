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

import random
from pathlib import Path

import numpy as np
import torch

from mindspeed.log import get_logger
from mindspeed_mm.demos import scene
from mindspeed_mm.demos.scene import COLOURS, DEFAULT_CACHE_DIR, SHAPES

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
    return scene.heldout_triples(list(POSITIONS), shift=1)


def draw_image(colour: str, shape: str, position: str, rng: random.Random) -> np.ndarray:
    """``[H, W, 3]`` uint8: the shape at a random size and offset inside its quadrant."""
    from PIL import Image, ImageDraw

    half = SIZE // 2
    side = rng.randint(9, 13)
    column, row = POSITIONS[position]
    left = column * half + rng.randint(1, half - side - 1)
    top = row * half + rng.randint(1, half - side - 1)
    image = Image.new("RGB", (SIZE, SIZE), tuple(rng.randint(0, 40) for _ in range(3)))
    scene.draw_shape(ImageDraw.Draw(image), shape, colour, left, top, side)
    return np.asarray(image)


def write_t2i_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """Write the demo's untrained pipeline (see the module docstring) into ``directory``."""
    from diffusers import FluxTransformer2DModel
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
        tokenizer = scene.word_tokenizer(words)
        tokenizer.model_max_length = TEXT_LEN
        tokenizer.save_pretrained(str(directory / name))
    encoders = {"text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel"}
    scene.write_pipeline_index(directory, "FluxPipeline", "FluxTransformer2DModel", encoders)
    return directory


def write_t2i_features(pipeline: str | Path, directory: str | Path, seed: int = 0) -> Path:
    """Draw the training images (every combination but the held-out ones) and cache their features."""
    from mindspeed_mm.data.features import write_features
    from mindspeed_mm.models.flux import FLUX

    held = heldout_combinations()
    parts, latents, drawn = scene.encode_training_set(
        pipeline, FLUX, POSITIONS, draw_image, IMAGES_PER_COMBINATION, held, seed
    )
    captions = [caption(*c) for c in drawn]
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
    heldout = [caption(*c) for c in heldout_combinations()]
    return scene.build_demo(root, "text-to-image", write_t2i_pipeline, write_t2i_features, heldout, logger)


def score_images(images: torch.Tensor, captions: list[str]) -> dict[str, float]:
    """Share of ``images`` (``[N, 3, H, W]`` in [0, 1]) whose dominant colour / quadrant matches the caption.

    The foreground is the pixels brighter than the background can be (max channel above 0.35); its
    mean colour's nearest palette colour is the image's colour, the quadrant of its centroid the
    image's position. No foreground: wrong.
    """
    quadrants = {v: k for k, v in POSITIONS.items()}
    right = {"colour": 0, "position": 0}
    for image, text in zip(images.float().cpu(), captions):
        mask = image.amax(dim=0) > 0.35  # [H, W]
        if mask.sum() == 0:
            continue
        mean = (image * mask).sum(dim=(1, 2)) / mask.sum()
        right["colour"] += scene.palette_name(mean) == text.split()[1]
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
    captions = [caption(*c) for c in heldout_combinations() for _ in range(seeds)]
    images = scene.sample_captions(
        load_dir, t2i_paths()["pipeline"], captions, seeds, (1, SIZE), TEXT_LEN, steps, guidance_scale
    )
    return images, captions
