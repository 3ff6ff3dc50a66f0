"""The shapes demo's image reward scores drawn pictures of the demo by their caption's colour and quadrant."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mindspeed_mm.demos.scene import COLOURS
from mindspeed_mm.demos.t2i import draw_image
from mindspeed_rl.rewards.image import IMAGE_REWARDS, build_image_reward, soft_shapes_score


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


def test_soft_shapes_reward_is_the_checker_on_drawn_pictures_and_dense_between() -> None:
    rng = random.Random(1)
    combos = [
        ("red", "circle", "top left"),
        ("blue", "square", "bottom right"),
        ("yellow", "triangle", "top right"),
        ("green", "triangle", "bottom left"),
    ]
    pictures = [draw_image(*c, rng) for c in combos]
    images = torch.from_numpy(np.stack(pictures)).movedim(-1, 1).float() / 255
    reward = build_image_reward("shapes_soft")
    right = [f"a {c} {s} in the {p}" for c, s, p in combos]
    assert reward(images, right).tolist() == [1.0] * 4
    wrong_place = ["a red circle in the bottom left", "a blue x in the top right", "a yellow x in the top left"]
    assert reward(images[:3], wrong_place).tolist() == [0.5] * 3
    wrong_colour = ["a green circle in the top left", "a red square in the bottom right"]  # nearest colours
    assert reward(images[:2], wrong_colour).tolist() == [0.0, 0.0]
    assert reward(images[2:3], ["a red triangle in the top right"]).tolist() == [0.0]  # yellow is not red
    assert reward(torch.zeros(1, 3, 32, 32), right[:1]).tolist() == [0.0]

    # Between: a picture by hand. 30 pure red pixels top left, 10 bottom right, 20 of pure green; a dim red
    # block of 20 pixels at max channel 0.3 (half foreground, x = 0.3 / 0.86 of red: far from the palette).
    red = torch.tensor(COLOURS["red"]) / 255
    green = torch.tensor(COLOURS["green"]) / 255
    image = torch.zeros(3, 32, 32)
    image[:, 2:5, 2:12] = red[:, None, None]  # 30 px, top left
    image[:, 20:22, 20:25] = red[:, None, None]  # 10 px, bottom right
    image[:, 26:28, 2:12] = green[:, None, None]  # 20 px, bottom left
    dim = red * 0.3 / red.max()
    image[:, 6:8, 20:30] = dim[:, None, None]  # 20 px, top right
    f_dim = (0.3 - 0.2) / (0.4 - 0.2)
    m_dim = f_dim * max(0.0, 1 - float((dim - red).norm()) / 0.33)
    named = 40 + 20 * m_dim
    colour_expected = named / (40 + 20 + 20 * f_dim)
    position_expected = (30 / named - 0.25) / 0.75  # corrected for chance
    colour, position = soft_shapes_score(image[None], ["a red square in the top left"])
    assert colour.item() == pytest.approx(colour_expected, rel=1e-5)
    assert position.item() == pytest.approx(position_expected, rel=1e-5)
    weighted = build_image_reward("shapes_soft", colour_weight=0.25, position_weight=0.75)(
        image[None], ["a red x in the top left"]
    )
    assert weighted.item() == pytest.approx(0.25 * colour_expected + 0.75 * position_expected, rel=1e-5)
    # A little of the named colour in a near-blank picture scores little: min_area pixels at least.
    speck = torch.zeros(1, 3, 32, 32)
    speck[0, :, 3, 3] = red
    assert soft_shapes_score(speck, ["a red x in the top left"])[0].item() == pytest.approx(1 / 16)
    # Colour spread evenly over the quadrants (noise) gets no position credit; uncorrected, a quarter.
    even = torch.zeros(1, 3, 32, 32)
    even[0, :, ::2, ::2] = red[:, None, None]
    assert soft_shapes_score(even, ["a red x in the top left"])[1].item() == 0.0
    assert soft_shapes_score(even, ["a red x in the top left"], position_chance=0.0)[1].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="names no demo colour"):
        reward(images[:1], ["a purple circle in the top left"])
    with pytest.raises(ValueError, match="one caption an image"):
        reward(images, right[:1])


def test_brightness_reward_is_the_mean_pixel() -> None:
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(build_image_reward("brightness")(images, ["a"] * 3), images.mean((1, 2, 3)))
