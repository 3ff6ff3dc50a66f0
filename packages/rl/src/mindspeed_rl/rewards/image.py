"""Rewards of generated images (diffusion RL): a registry of scorers ``fn(images, captions) -> [N]``.

``images`` are ``[N, 3, H, W]`` pixels in [0, 1] (the decoded samples), ``captions`` their prompts. A rule
reward and a reward model are registered alike, as factories (``IMAGE_REWARDS.get(name)(**options)``): a
reward model is a factory that loads its network and returns the scorer.

``shapes``: the embedded text-to-image demo's checker (:func:`mindspeed_mm.demos.t2i.score_images`): half
for the colour the caption names (the palette colour nearest to the mean of the bright pixels) and half for
its quadrant (that of their centroid); 0 for an image without bright pixels.

``shapes_soft``: a dense score of the same checks, in [0, 1] (:func:`soft_shapes_score`): each pixel is
foreground by its brightness and of the named colour by its distance to that palette colour (both ramps, not
thresholds), and the score is half the share of the foreground that has the named colour and half the share
of the named colour that lies in the named quadrant. A drawn picture scores as ``shapes`` does (1, 0.5, 0);
a sample that is partly right scores in between, so that samples of one caption differ in reward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mindspeed.registry import Registry
from mindspeed_mm.demos.scene import COLOURS
from mindspeed_mm.demos.t2i import POSITIONS, score_images

ImageReward = Callable[[torch.Tensor, Sequence[str]], torch.Tensor]

#: name -> factory(**options) -> image reward.
IMAGE_REWARDS: Registry[Callable[..., ImageReward]] = Registry("image reward")


@IMAGE_REWARDS.register("shapes")
def shapes_reward(colour_weight: float = 0.5, position_weight: float = 0.5) -> ImageReward:
    """The shapes demo's colour and position checks, weighted (each 0 or 1 an image)."""

    def score(images: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
        if images.shape[0] != len(captions):
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions: give one caption an image")
        rows = [score_images(image[None], [text]) for image, text in zip(images, captions)]
        return torch.tensor([colour_weight * r["colour"] + position_weight * r["position"] for r in rows])

    return score


def soft_shapes_score(
    images: torch.Tensor,
    captions: Sequence[str],
    dark: float = 0.2,
    bright: float = 0.4,
    colour_radius: float = 0.33,
    min_area: float = 16.0,
    position_chance: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense colour and position scores ``[N]`` each, in [0, 1], of ``images`` (``[N, 3, H, W]`` in [0, 1]).

    Per pixel ``x``: foreground ``f = clamp((max_channel(x) - dark) / (bright - dark), 0, 1)`` (the demo's
    backgrounds are at most 40 / 255, its colours at least 0.82 in one channel); named colour
    ``m = f * clamp(1 - |x - c| / colour_radius, 0, 1)`` with ``c`` the caption's palette colour (0.33: half
    the nearest two palette colours' distance, so no pixel counts for two colours). Colour score:
    ``sum m / max(sum f, min_area)``; position score: the share ``s = sum of m over the caption's quadrant /
    max(sum m, min_area)`` (``min_area`` pixels, below the smallest drawn shape's, keep a nearly blank image near
    0) corrected for chance, ``clamp((s - position_chance) / (1 - position_chance), 0, 1)``: colour spread
    evenly over the picture (noise) has a share of 1/4 and scores 0 (without the correction,
    ``position_chance=0``, a Flow-GRPO run learnt to paint noise: docs/mm/dit-rl.md).
    """
    if images.shape[0] != len(captions):
        raise ValueError(f"{images.shape[0]} images but {len(captions)} captions: give one caption an image")
    images = images.float()
    height, width = images.shape[-2:]
    foreground = ((images.amax(1) - dark) / (bright - dark)).clamp(0, 1)  # [N, H, W]
    colour_of, position_of = [], []
    for text in captions:
        words = text.split()
        colour = next((w for w in words if w in COLOURS), None)
        position = next((p for p in POSITIONS if text.endswith(p)), None)
        if colour is None or position is None:
            raise ValueError(f"caption {text!r} names no demo colour ({', '.join(COLOURS)}) or position")
        colour_of.append(COLOURS[colour])
        position_of.append(POSITIONS[position])
    palette = torch.tensor(colour_of, dtype=torch.float32, device=images.device)[:, :, None, None] / 255
    match = foreground * (1 - (images - palette).norm(dim=1) / colour_radius).clamp(0, 1)
    quadrant = torch.zeros_like(match)
    for i, (column, row) in enumerate(position_of):
        rows = slice(0, height // 2) if row == 0 else slice(height // 2, height)
        columns = slice(0, width // 2) if column == 0 else slice(width // 2, width)
        quadrant[i, rows, columns] = 1
    named = match.sum((1, 2))
    colour_score = named / foreground.sum((1, 2)).clamp_min(min_area)
    share = (match * quadrant).sum((1, 2)) / named.clamp_min(min_area)
    position_score = ((share - position_chance) / (1 - position_chance)).clamp(0, 1)
    return colour_score, position_score


@IMAGE_REWARDS.register("shapes_soft")
def shapes_soft_reward(colour_weight: float = 0.5, position_weight: float = 0.5, **options: float) -> ImageReward:
    """:func:`soft_shapes_score`'s colour and position scores, weighted (``options``: its ramps)."""

    def score(images: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
        colour, position = soft_shapes_score(images, captions, **options)
        return (colour_weight * colour + position_weight * position).cpu()

    return score


@IMAGE_REWARDS.register("brightness")
def brightness_reward() -> ImageReward:
    """The images' mean pixel value: an easy reward that checks that a loop moves the policy up its reward."""

    def score(images: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
        if images.shape[0] != len(captions):
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions: give one caption an image")
        return images.float().mean((1, 2, 3)).cpu()

    return score


def build_image_reward(name: str, **options) -> ImageReward:
    """The image reward ``name`` built with ``options``.

    Raises:
        ValueError: unknown reward (listing the known ones) or an option it does not take.
    """
    factory = IMAGE_REWARDS.get(name)
    try:
        return factory(**options)
    except TypeError as err:
        raise ValueError(f"image reward {name!r}: {err}") from err
