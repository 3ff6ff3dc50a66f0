"""The vision-language demo policy: the multimodal suite's tiny Qwen2.5-VL, warm-started on its shapes demo.

GRPO learns only from groups whose rewards differ, and the untrained demo VLM answers bytes at
random (reward 0 everywhere). :func:`vlm_demo_paths` writes the shapes demo of ``mindspeed_mm``
(:mod:`mindspeed_mm.demos.vlm`: coloured squares, circles and triangles; "What colour is the
shape?" / "What shape is it?", one-word answers) and a Hugging Face directory of the tiny Qwen2.5-VL
after :data:`WARM_STEPS` supervised steps on its training questions: enough for the model to answer
with one of the answer words (mostly the most frequent ones), not enough to read the pictures, so
the held-out accuracy starts near chance and GRPO has room to raise it.

In a recipe with ``actor.model_type: vlm``, ``actor.model: demo`` stands for this policy and
``data.path: demo`` / ``data.eval_path: demo-heldout`` for the demo's questions (built once into
``runs/rl-vlm-demo``; deterministic in the seed).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from mindspeed.log import get_logger
from mindspeed_mm.data.encode import encode_sample
from mindspeed_mm.data.mllm import read_mllm_files
from mindspeed_mm.demos.scene import settle
from mindspeed_mm.demos.vlm import DEMO, HELDOUT, demo_paths
from mindspeed_mm.models import family_of, load_model, load_processing

logger = get_logger(__name__)

DEFAULT_VLM_CACHE_DIR = Path("runs/rl-vlm-demo")
#: Supervised steps of 8 questions each (lr 3e-3, AdamW): answers in the demo's words, near chance accuracy.
WARM_STEPS = 40
#: The demo's image bounds (56 x 56 pictures: 4 image tokens each).
DEMO_MIN_PIXELS, DEMO_MAX_PIXELS = 784, 3136


def warm_start(model_dir: Path, train_file: Path, target: Path, steps: int, seed: int = 0) -> None:
    """Write ``model_dir``'s model after ``steps`` supervised steps (8 questions each) on ``train_file`` to ``target``."""
    torch.manual_seed(seed)
    family = family_of(model_dir)
    model = load_model(model_dir, family).train()
    tokenizer, processor = load_processing(model_dir, DEMO_MIN_PIXELS, DEMO_MAX_PIXELS)
    samples = read_mllm_files([str(train_file)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        for sample in rng.sample(samples, 8):
            encoded = encode_sample(sample, tokenizer, processor, family, 4096)
            out = model(
                input_ids=encoded.input_ids[None],
                labels=encoded.labels[None],
                mm_token_type_ids=encoded.mm_token_type_ids[None],
                **encoded.vision,
            )
            (out.loss / 8).backward()
        optimizer.step()
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(model_dir, target)  # tokenizer, processors, chat template as the demo ships them
    model.save_pretrained(target)  # the warm-started weights over the random ones


def vlm_demo_paths(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build the demo once: ``{"model": warm-started HF directory, "train": questions, "heldout": questions}``."""
    root = Path(cache_dir or DEFAULT_VLM_CACHE_DIR)
    paths = demo_paths(root / "mm")
    model = root / f"warm{WARM_STEPS}"
    if not (model / "config.json").is_file():
        logger.info("warm-starting the vision-language demo policy into %s (once, ~40 s)", model)
        tmp = root / f"warm{WARM_STEPS}.tmp"
        warm_start(paths["model"], paths["train"], tmp, WARM_STEPS)
        settle(tmp, model, "config.json")
    return {"model": model, "train": paths["train"], "heldout": paths["heldout"]}


def resolve_vlm_names(model: str | None, path: str, eval_path: str | None) -> tuple[str | None, str, str | None]:
    """``(actor.model, data.path, data.eval_path)`` with the demo names (``demo``, ``demo-heldout``) replaced."""
    if DEMO not in (model, path) and eval_path != HELDOUT:
        return model, path, eval_path
    paths = vlm_demo_paths()
    names = {DEMO: str(paths["train"]), HELDOUT: str(paths["heldout"])}
    return (
        str(paths["model"]) if model == DEMO else model,
        names.get(path, path),
        names.get(eval_path, eval_path) if eval_path is not None else None,
    )
