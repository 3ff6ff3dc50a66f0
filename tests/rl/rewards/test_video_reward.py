"""Video rewards against the text-to-video demo's drawn clips and hand-built videos."""

from __future__ import annotations

import random

import pytest
import torch

from mindspeed_mm.demos.t2v import caption, draw_clip
from mindspeed_rl.rewards.image import build_image_reward
from mindspeed_rl.rewards.video import motion_score


def clip(colour: str, shape: str, direction: str, seed: int = 0) -> torch.Tensor:
    frames = torch.from_numpy(draw_clip(colour, shape, direction, random.Random(seed)))  # [F, H, W, 3]
    return frames.permute(0, 3, 1, 2).float() / 255


def test_t2v_shapes_and_motion_on_drawn_clips() -> None:
    videos = torch.stack([clip("red", "circle", "left", s) for s in range(4)])
    captions = [
        caption("red", "circle", "left"),  # right
        caption("red", "square", "right"),  # colour right, direction opposite
        caption("blue", "circle", "up"),  # both wrong (perpendicular)
        caption("green", "triangle", "left"),  # direction right
    ]
    shapes = build_image_reward("t2v_shapes")(videos, captions)
    assert shapes.tolist() == [1.0, 0.5, 0.0, 0.5]
    motion = build_image_reward("t2v_motion")(videos, captions)
    torch.testing.assert_close(motion, torch.tensor([1.0, -1.0, 0.0, 1.0]), rtol=0, atol=1e-5)
    brightness = build_image_reward("video_brightness")(videos, captions)
    torch.testing.assert_close(brightness, videos.mean((1, 2, 3, 4)))


def test_motion_by_hand() -> None:
    video = torch.zeros(1, 4, 3, 24, 24)
    for f in range(4):
        video[0, f, :, 5 + 2 * f, 10] = 1.0  # one white pixel moving 2 pixels down a frame: 6 of 12
    torch.testing.assert_close(motion_score(video, ["a red square moving down"]), torch.tensor([0.5]))
    torch.testing.assert_close(motion_score(video, ["a red square moving up"]), torch.tensor([-0.5]))
    assert motion_score(video, ["a red square moving left"]).tolist() == [0.0]
    video[0, -1] = 0  # the last frame is empty: no motion to measure
    assert motion_score(video, ["a red square moving down"]).tolist() == [0.0]
    with pytest.raises(ValueError, match="direction"):
        motion_score(video, ["a red square"])
    with pytest.raises(ValueError, match=r"\[N, F, 3, H, W\]"):
        build_image_reward("t2v_motion")(video[:, 0], ["a red square moving down"])
