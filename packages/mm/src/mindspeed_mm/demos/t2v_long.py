"""The long-video memory demo (``demo-t2v-long``): the Wan and the long latents whose memory per rank is measured.

``examples/mm/t2v_long_sp2.yaml`` trains :data:`LONG_WAN` (8 heads of 32, hidden 256, 4 blocks, 16
latent channels: 4.9 M parameters) on clips of latents :data:`LONG_SHAPE` (3,456 video tokens after the
1 x 2 x 2 patches) with :data:`LONG_TEXT_LEN` text tokens, under Ulysses sequence parallelism over 2
ranks. ``tools/bench/dit.py`` part 2 measures one training step of the same model and latents at SP1
and SP2 (docs/mm/dit-parallelism.md). The latents and text embeddings are random: the recipe shows
memory and parallelism, not learning (the demos of :mod:`~mindspeed_mm.demos.t2v` learn).

Built once into ``runs/mm-demo/t2v-long-v*/`` (``transformer``, ``features``) on first use;
``model.path: demo-t2v-long`` and ``data.features: demo-t2v-long`` stand for them
(:mod:`mindspeed_mm.demos.names`). Ranks started together (torchrun) may build at once: each writes
under a name of its own and the first rename wins.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from mindspeed.log import get_logger
from mindspeed_mm.demos.scene import DEFAULT_CACHE_DIR, settle

logger = get_logger(__name__)

T2V_LONG = "demo-t2v-long"
BUILDER_VERSION = 1
#: The measured Wan: 8 heads of 32 (hidden 256; the heads divide by 2, 4 and 8 ranks), 4 blocks, 16 latent channels.
LONG_WAN = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 8,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 256,
    "freq_dim": 256,
    "ffn_dim": 1024,
    "num_layers": 4,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
}
#: Latents ``C, F, H, W`` of a long clip: 9 latent frames of 32 x 48 (a 33-frame 256 x 384 video under Wan's VAE).
LONG_SHAPE = (16, 9, 32, 48)
LONG_TEXT_LEN = 64
NUM_CLIPS = 8


def write_random_features(
    directory: str | Path, shape: tuple[int, ...], count: int, text_len: int, text_dim: int, seed: int
) -> Path:
    """A feature cache of ``count`` random samples: latents of ``shape``, text embeddings of ``text_len - i % 8``
    tokens of ``text_dim`` (varying lengths, as captions have), all drawn from one generator seeded ``seed``."""
    from mindspeed_mm.data.features import write_features

    gen = torch.Generator().manual_seed(seed)
    samples = [
        {"latents": torch.randn(shape, generator=gen), "text": torch.randn(text_len - i % 8, text_dim, generator=gen)}
        for i in range(count)
    ]
    return write_features(directory, samples, [f"clip {i}" for i in range(count)])


def long_demo_paths(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build the long-video demo's transformer and feature cache once (in ``cache_dir``).

    Returns:
        ``{"transformer", "features"}``.
    """
    from mindspeed_mm.models.dit import write_tiny_dit
    from mindspeed_mm.models.wan import WAN

    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"t2v-long-v{BUILDER_VERSION}"
    paths = {"transformer": root / "transformer", "features": root / "features"}
    mine = f".{os.getpid()}.tmp"
    if not (paths["transformer"] / "config.json").is_file():
        logger.info("writing the long-video demo transformer into %s (once)", paths["transformer"])
        tmp = root / f"transformer{mine}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_tiny_dit(tmp, WAN.architecture, seed=0, **LONG_WAN)
        settle(tmp, paths["transformer"], "config.json")
    if not (paths["features"] / "index.jsonl").is_file():
        logger.info("writing the long-video demo features into %s (once)", paths["features"])
        tmp = root / f"features{mine}"
        write_random_features(tmp, LONG_SHAPE, NUM_CLIPS, LONG_TEXT_LEN, LONG_WAN["text_dim"], seed=2)
        settle(tmp, paths["features"], "index.jsonl")
    return paths
