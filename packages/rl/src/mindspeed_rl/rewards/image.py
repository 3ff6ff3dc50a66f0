"""Rewards of generated images (diffusion RL): a registry of scorers ``fn(images, captions) -> [N]``.

``images`` are ``[N, 3, H, W]`` pixels in [0, 1] (the decoded samples), ``captions`` their prompts. A rule
reward and a reward model are registered alike, as factories (``IMAGE_REWARDS.get(name)(**options)``): a
reward model is a factory that loads its network and returns the scorer.

``shapes``: the embedded text-to-image demo's checker (:func:`mindspeed_mm.demos.t2i.score_images`): half
for the colour the caption names (the palette colour nearest to the mean of the bright pixels) and half for
its quadrant (that of their centroid); 0 for an image without bright pixels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mindspeed.registry import Registry
from mindspeed_mm.demos.t2i import score_images

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
