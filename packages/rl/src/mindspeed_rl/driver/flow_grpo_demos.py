"""The embedded demos a Flow-GRPO run trains on (``FlowGRPOConfig.demo``): their captions, sample size and checks.

- ``t2i``: the text-to-image shapes demo (:mod:`mindspeed_mm.demos.t2i`, tiny FLUX): 32 x 32 images, colour and
  position checks.
- ``t2v``: the text-to-video demo (:mod:`mindspeed_mm.demos.t2v`, tiny Wan): 4 frames of 24 x 24 pixels
  (latents ``[12, 4, 12, 12]``), colour and direction checks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mindspeed.registry import Registry
from mindspeed_mm.demos import t2i, t2v
from mindspeed_mm.demos.scene import COLOURS, SHAPES


@dataclass(frozen=True)
class FlowGRPODemo:
    """One demo: where its pipeline is, its training and held-out captions, the sample size and its checks.

    Attributes:
        pipeline: builds (once) and returns the demo's pipeline directory.
        training_captions / heldout_captions: the captions RL samples / the held-out check samples.
        frames / height / width: one sample in pixels (frames 1: an image).
        checks: ``(pixels, captions) -> {name: share right}`` (the decoded samples).
    """

    pipeline: Callable[[], Path]
    training_captions: Callable[[], list[str]]
    heldout_captions: Callable[[], list[str]]
    frames: int
    height: int
    width: int
    checks: Callable[[torch.Tensor, list[str]], dict[str, float]]


#: name -> demo.
FLOW_GRPO_DEMOS: Registry[FlowGRPODemo] = Registry("flow-grpo demo")


def _captions(module, places) -> list[str]:
    held = set(module.heldout_combinations())
    return [module.caption(*c) for c in itertools.product(COLOURS, SHAPES, places) if c not in held]


FLOW_GRPO_DEMOS.register(
    "t2i",
    FlowGRPODemo(
        pipeline=lambda: t2i.t2i_paths()["pipeline"],
        training_captions=lambda: _captions(t2i, t2i.POSITIONS),
        heldout_captions=lambda: [t2i.caption(*h) for h in t2i.heldout_combinations()],
        frames=1,
        height=t2i.SIZE,
        width=t2i.SIZE,
        checks=t2i.score_images,
    ),
)
FLOW_GRPO_DEMOS.register(
    "t2v",
    FlowGRPODemo(
        pipeline=lambda: t2v.demo_paths()["pipeline"],
        training_captions=lambda: _captions(t2v, t2v.DIRECTIONS),
        heldout_captions=lambda: [t2v.caption(*h) for h in t2v.heldout_combinations()],
        frames=t2v.NUM_FRAMES,
        height=t2v.SIZE,
        width=t2v.SIZE,
        checks=t2v.score_videos,
    ),
)
