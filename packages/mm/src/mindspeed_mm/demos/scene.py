"""What the text-to-image and text-to-video demos share: the scene (one coloured shape on a dark
background), its held-out combinations, the tiny pipeline's tokenizer, the cache the demo is built into
once, and sampling the held-out captions from a trained transformer.

:mod:`~mindspeed_mm.demos.t2i` places the shape in a quadrant, :mod:`~mindspeed_mm.demos.t2v` moves it;
each keeps its own sizes, captions and scores.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_CACHE_DIR = Path("runs/mm-demo")
#: colour name -> its RGB fill.
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")


def draw_shape(draw: Any, shape: str, colour: str, left: int, top: int, side: int) -> None:
    """Draw ``shape`` filled with ``colour`` in the ``side`` x ``side`` box at (``left``, ``top``) (a PIL ``ImageDraw``)."""
    box = (left, top, left + side - 1, top + side - 1)
    if shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    else:
        draw.polygon(
            [(left + side // 2, top), (left, top + side - 1), (left + side - 1, top + side - 1)], fill=COLOURS[colour]
        )


def heldout_triples(places: Sequence[str], shift: int) -> list[tuple[str, str, str]]:
    """The 8 (colour, shape, place) combinations never trained on: each colour and each place twice
    (place ``i + 2 k + shift`` of colour ``i``'s ``k``-th)."""
    return [
        (c, SHAPES[(i + k) % len(SHAPES)], places[(i + 2 * k + shift) % len(places)])
        for i, c in enumerate(COLOURS)
        for k in range(2)
    ]


def encode_training_set(
    pipeline: str | Path,
    family: Any,
    places: Sequence[str],
    draw: Callable[[str, str, str, random.Random], np.ndarray],
    per_combination: int,
    heldout: list[tuple[str, str, str]],
    seed: int,
) -> tuple[dict[str, Any], torch.Tensor, list[tuple[str, str, str]]]:
    """Draw ``per_combination`` pictures of every (colour, shape, place) but the ``heldout`` ones from one
    generator seeded ``seed`` and encode them with the VAE of the demo's ``pipeline`` of ``family``.

    Returns:
        the pipeline's parts (its text encoders for the captions), the latents, the combination of each.
    """
    from mindspeed_mm.inference.dit_pipeline import load_parts
    from mindspeed_mm.models.encoders import encode_latents

    parts = load_parts(Path(pipeline), family, torch.device("cpu"), torch.float32)
    rng = random.Random(seed)
    combinations = [c for c in itertools.product(COLOURS, SHAPES, places) if c not in set(heldout)]
    drawn = [(c, draw(*c, rng)) for c in combinations for _ in range(per_combination)]
    pixels = torch.from_numpy(np.stack([picture for _, picture in drawn])).movedim(-1, 1).float() / 127.5 - 1
    return parts, encode_latents(parts["vae"], pixels), [c for c, _ in drawn]


def write_pipeline_index(directory: Path, pipeline: str, transformer: str, text_encoders: dict[str, str]) -> None:
    """Write the demo pipeline's scheduler and ``model_index.json``: its transformer, the PatchVAE and each
    text encoder (``{folder: transformers class}``, ``text_encoder_2`` with ``tokenizer_2``) with its tokenizer."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).save_pretrained(str(directory / "scheduler"))
    text_parts: dict[str, list[str]] = {}
    for folder, cls in text_encoders.items():
        text_parts[folder] = ["transformers", cls]
        text_parts[folder.replace("text_encoder", "tokenizer")] = ["transformers", "PreTrainedTokenizerFast"]
    index = {
        "_class_name": pipeline,
        "_mindspeed_note": "the vae is mindspeed_mm's PatchVAE",
        "transformer": ["diffusers", transformer],
        "vae": ["mindspeed_mm.diffusion.patch_vae", "PatchVAE"],
        **text_parts,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (directory / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def palette_name(mean: torch.Tensor) -> str:
    """The colour of :data:`COLOURS` nearest to the RGB ``mean`` (in [0, 1])."""
    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32) / 255
    return list(COLOURS)[int(torch.cdist(mean[None], palette).argmin())]


def word_tokenizer(words: list[str]) -> Any:
    """A word-level fast tokenizer over ``words`` (pad 0, eos 1 appended, unk 2; lowercased, split on spaces)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def settle(tmp: Path, final: Path, marker: str) -> None:
    """Rename the finished ``tmp`` to ``final``; when another rank or run got there first, drop ``tmp``."""
    try:
        tmp.replace(final)
    except OSError:  # another rank or run finished first
        if not (final / marker).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def build_demo(
    root: Path,
    what: str,
    write_pipeline: Callable[[Path], Path],
    write_features: Callable[[Path, Path], Path],
    heldout: list[str],
    log: Any,
) -> dict[str, Path]:
    """Build a demo's pipeline, training features and held-out captions once, under ``root``.

    Args:
        root: the demo's versioned cache directory.
        what: the demo's name in the log lines (``text-to-image``).
        write_pipeline: writes the untrained pipeline into a directory.
        write_features: writes the training features of a pipeline into a directory.
        heldout: the held-out captions.
        log: the demo module's logger (the lines name the demo's module).

    Returns:
        ``{"pipeline", "transformer", "features", "heldout"}``.
    """
    paths = {
        "pipeline": root / "pipeline",
        "transformer": root / "pipeline" / "transformer",
        "features": root / "features",
        "heldout": root / "heldout.txt",
    }
    if not (paths["pipeline"] / "model_index.json").is_file():
        log.info("writing the %s demo pipeline into %s (once)", what, paths["pipeline"])
        tmp = root / "pipeline.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_pipeline(tmp)
        settle(tmp, paths["pipeline"], "model_index.json")
    if not (paths["features"] / "index.jsonl").is_file():
        log.info("writing the %s demo features into %s (once)", what, paths["features"])
        write_features(paths["pipeline"], paths["features"])
    if not paths["heldout"].is_file():
        paths["heldout"].write_text("".join(line + "\n" for line in heldout))
    return paths


def sample_captions(
    load_dir: str | Path,
    pipeline: Path,
    captions: list[str],
    seeds: int,
    frames_and_size: tuple[int, int],
    text_len: int,
    steps: int,
    guidance_scale: float,
) -> torch.Tensor:
    """Decoded samples of ``captions`` (caption ``i`` from noise seeded ``i % seeds``) by the transformer of
    ``load_dir`` (a directory or DCP checkpoint of the demo's model) in the demo's ``pipeline``; a family
    with a pooled text embedding (FLUX) gets it and its empty caption's."""
    from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
    from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline

    loaded = load_dit_pipeline(load_dir, base_dir=pipeline / "transformer", pipeline_dir=pipeline)
    family = loaded.family
    frames, size = frames_and_size
    shape = latent_shape(loaded.parts["vae"], family, frames, size, size)
    noise = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(i % seeds)) for i in range(len(captions))]
    )
    text, pooled = family.encode_prompts(loaded.parts, captions, text_len)
    negative, negative_pooled = family.encode_prompts(loaded.parts, [""], text_len)
    latents = sample_latents(
        loaded.model,
        family,
        build_scheduler(family, pipeline),
        noise,
        text,
        steps,
        pooled,
        negative.expand(len(captions), -1, -1),
        negative_pooled.expand(len(captions), -1) if negative_pooled is not None else None,
        guidance_scale,
    )
    return decode_latents(loaded.parts["vae"], latents)
