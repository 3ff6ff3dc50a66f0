"""The shapes demo's image reward scores drawn pictures of the demo by their caption's colour and quadrant."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mindspeed_mm.demos.t2i import draw_image
from mindspeed_rl.rewards.image import IMAGE_REWARDS, build_image_reward


def test_shapes_reward_checks_colour_and_position() -> None:
    rng = random.Random(0)
    pictures = [draw_image("red", "circle", "top left", rng), draw_image("blue", "square", "bottom right", rng)]
    images = torch.from_numpy(np.stack(pictures)).movedim(-1, 1).float() / 255
    reward = build_image_reward("shapes")
    right = reward(images, ["a red circle in the top left", "a blue square in the bottom right"])
    assert right.tolist() == [1.0, 1.0]
    half = reward(images, ["a green circle in the top left", "a blue square in the top left"])
    assert half.tolist() == [0.5, 0.5]
    assert reward(images, ["a green circle in the bottom right", "a red square in the top left"]).tolist() == [0.0, 0.0]
    assert build_image_reward("shapes", colour_weight=1.0, position_weight=0.0)(
        images[:1], ["a red x in the bottom left"]
    ).tolist() == [1.0]
    assert reward(torch.zeros(1, 3, 32, 32), ["a red circle in the top left"]).tolist() == [0.0]  # nothing drawn
    with pytest.raises(ValueError, match="known"):
        build_image_reward("aesthetic")
    with pytest.raises(ValueError, match="shapes"):
        build_image_reward("shapes", gamma=1)
    assert "shapes" in IMAGE_REWARDS
