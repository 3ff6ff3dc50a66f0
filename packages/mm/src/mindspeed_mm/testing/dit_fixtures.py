"""A tiny diffusion transformer directory and a random feature cache for it, built in code (no download)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.data.features import write_features
from mindspeed_mm.models.dit import DIT_FAMILIES, write_tiny_dit

#: condition name -> ``(model config, latent shape, generator) -> a random value`` of one sample.
RANDOM_CONDITIONS: dict[str, Callable[[dict[str, Any], tuple[int, ...], torch.Generator], torch.Tensor]] = {
    "image_latents": lambda config, shape, gen: torch.randn(shape, generator=gen),
    "image_embeds": lambda config, shape, gen: torch.randn(
        config.get("pos_embed_seq_len") or 5, config["image_dim"], generator=gen
    ),
}


def write_tiny_dit_run(
    directory: str | Path,
    architecture: str,
    num_samples: int = 8,
    latent_shapes: list[tuple[int, ...]] | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """``(model directory, feature cache)``: a tiny random model of ``architecture`` and ``num_samples``
    random samples for it (latents of the shapes of ``latent_shapes`` in turn, default one shape;
    text embeddings of 2-5 tokens; pooled embeddings where the model takes them; the family's
    conditions where it takes some (:data:`RANDOM_CONDITIONS`); an empty caption's embedding of 1 token).
    """
    directory = Path(directory)
    family = DIT_FAMILIES.get(architecture)
    model_dir = write_tiny_dit(directory / "transformer", architecture, seed)
    config = family.tiny_config
    text_dim = config.get("text_dim") or config["joint_attention_dim"]
    if latent_shapes is None:
        channels = config.get("out_channels") or config["in_channels"]
        channels = family.latent_channels(config) if family.latent_channels is not None else channels
        latent_shapes = [(channels, 3, 4, 4) if family.latent_dims == 4 else (channels, 4, 4)]
    gen = torch.Generator().manual_seed(seed + 1)
    samples = []
    for i in range(num_samples):
        sample = {
            "latents": torch.randn(latent_shapes[i % len(latent_shapes)], generator=gen),
            "text": torch.randn(2 + i % 4, text_dim, generator=gen),
        }
        if family.needs_pooled:
            sample["pooled"] = torch.randn(config["pooled_projection_dim"], generator=gen)
        for key in family.condition_keys(config):
            sample[key] = RANDOM_CONDITIONS[key](config, tuple(sample["latents"].shape), gen)
        samples.append(sample)
    null = {"text": torch.randn(1, text_dim, generator=gen)}
    if family.needs_pooled:
        null["pooled"] = torch.randn(config["pooled_projection_dim"], generator=gen)
    captions = [f"sample {i}" for i in range(num_samples)]
    return model_dir, write_features(directory / "features", samples, captions, null)
