"""A tiny model directory of a registered family and a small image-question data set, built in code (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mindspeed_mm.models.family import FAMILIES


def write_tiny_model(
    directory: str | Path, architecture: str = "Qwen2_5_VLForConditionalGeneration", seed: int = 0
) -> Path:
    """Write the family's tiny model (config, random weights, tokenizer, image processor) into ``directory``."""
    directory = Path(directory)
    FAMILIES.get(architecture).write_tiny(directory, seed)
    return directory


def write_tiny_dataset(directory: str | Path, num_samples: int = 8, seed: int = 0, text_only_every: int = 4) -> Path:
    """``directory/data.jsonl`` plus PNG images: "What colour is the square?" style samples.

    Every ``text_only_every``-th sample has no image; sizes vary so the patch grids differ.
    """
    from PIL import Image

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    lines = []
    for i in range(num_samples):
        name = list(colours)[i % 3]
        if text_only_every and i % text_only_every == text_only_every - 1:
            lines.append(
                {"messages": [{"role": "user", "content": f"Say {name}."}, {"role": "assistant", "content": name}]}
            )
            continue
        height, width = (int(x) for x in rng.choice([28, 56, 84], size=2))
        pixels = np.clip(np.array(colours[name]) + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
        path = directory / "images" / f"{i:04d}.png"
        Image.fromarray(pixels).save(path)
        lines.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>What colour is it?"},
                    {"role": "assistant", "content": f"It is {name}."},
                ],
                "images": [f"images/{path.name}"],
            }
        )
    target = directory / "data.jsonl"
    target.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target
