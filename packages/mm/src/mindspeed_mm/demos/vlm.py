"""The embedded demo: a tiny Qwen2.5-VL and a synthetic image-question set it can learn on a CPU.

Images are coloured shapes (square, circle, triangle in red, green, blue, yellow) at random
places and sizes on a dark background; the questions ask the colour or the shape, the answers
are one word. ``model.path: demo`` and ``data.files: [demo]`` in a recipe stand for them:
:func:`~mindspeed_mm.demos.names.resolve_demo` writes both once into ``runs/mm-demo`` (a training set, and a held-out
set of new images, ``demo-heldout``). :func:`choice_accuracy` scores a model on held-out
samples by the likelihood of each candidate answer (chance: 1/4 for colours, 1/3 for shapes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger
from mindspeed_mm.demos.scene import COLOURS, DEFAULT_CACHE_DIR, SHAPES, settle

logger = get_logger(__name__)

DEMO = "demo"
HELDOUT = "demo-heldout"
BUILDER_VERSION = 1
QUESTIONS = {"colour": "<image>What colour is the shape?", "shape": "<image>What shape is it?"}


def _draw(shape: str, colour: tuple[int, int, int], size: int, rng: random.Random) -> Any:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), tuple(rng.randint(0, 50) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    side = rng.randint(size // 3, size * 3 // 4)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    if shape == "square":
        draw.rectangle((x, y, x + side, y + side), fill=colour)
    elif shape == "circle":
        draw.ellipse((x, y, x + side, y + side), fill=colour)
    else:
        draw.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=colour)
    return image


def write_demo_data(directory: str | Path, num_images: int, seed: int, name: str) -> Path:
    """``directory/name.jsonl`` with two questions per image (colour and shape) and the PNGs under ``directory/images``."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(num_images):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        image = f"images/{name}-{i:05d}.png"
        _draw(shape, COLOURS[colour], 56, rng).save(directory / image)
        for kind, answer in (("colour", colour), ("shape", shape)):
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": QUESTIONS[kind]},
                        {"role": "assistant", "content": answer},
                    ],
                    "images": [image],
                }
            )
    target = directory / f"{name}.jsonl"
    tmp = target.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(target)
    return target


def demo_paths(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build the demo model and data once (in ``cache_dir``); returns ``{"model", "train", "heldout"}``."""
    from mindspeed_mm.testing.fixtures import write_tiny_model

    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"v{BUILDER_VERSION}"
    paths = {
        "model": root / "model",
        "train": root / "data" / "train.jsonl",
        "heldout": root / "data" / "heldout.jsonl",
    }
    if not (paths["model"] / "config.json").is_file():
        logger.info("writing the demo model into %s (once)", paths["model"])
        tmp = root / "model.tmp"
        write_tiny_model(tmp)
        settle(tmp, paths["model"], "config.json")
    if not paths["heldout"].is_file():
        logger.info("writing the demo data into %s (once)", paths["train"].parent)
        write_demo_data(paths["train"].parent, 600, seed=0, name="train")
        write_demo_data(paths["train"].parent, 60, seed=1, name="heldout")
    return paths


def choice_accuracy(model_dir: str | Path, data_file: str | Path, max_samples: int | None = None) -> dict[str, float]:
    """Held-out accuracy per question kind: the candidate answer with the lowest loss is the model's choice.

    Returns:
        ``{"colour": accuracy, "shape": accuracy}``.
    """
    import torch

    from mindspeed_mm.data.encode import encode_sample
    from mindspeed_mm.data.mllm import MllmSample, read_mllm_files
    from mindspeed_mm.models import family_of, load_model, load_processing

    family = family_of(model_dir)
    model = load_model(model_dir, family).eval()
    tokenizer, processor = load_processing(model_dir, 784, 3136)
    right: dict[str, list[bool]] = {"colour": [], "shape": []}
    for sample in read_mllm_files([str(data_file)], max_samples=max_samples):
        kind = "colour" if sample.messages[0]["content"] == QUESTIONS["colour"] else "shape"
        choices = list(COLOURS) if kind == "colour" else list(SHAPES)
        scores = []
        for choice in choices:
            messages = (sample.messages[0], {"role": "assistant", "content": choice})
            encoded = encode_sample(
                MllmSample(messages, sample.images, sample.source), tokenizer, processor, family, 4096
            )
            with torch.no_grad():
                out = model(
                    input_ids=encoded.input_ids[None],
                    labels=encoded.labels[None],
                    use_cache=False,
                    mm_token_type_ids=encoded.mm_token_type_ids[None],
                    **encoded.vision,
                )
            scores.append(float(out.loss) * encoded.num_label_tokens)
        right[kind].append(choices[scores.index(min(scores))] == sample.messages[1]["content"])
    return {kind: sum(hits) / max(len(hits), 1) for kind, hits in right.items()}
