"""Rewards of generated videos (diffusion RL on Wan): scorers ``fn(videos, captions) -> [N]`` in the image-reward
registry (:data:`~mindspeed_rl.rewards.image.IMAGE_REWARDS`, one registry of pixel rewards; importing this module
registers them).

``videos`` are ``[N, F, 3, H, W]`` pixels in [0, 1] (what :func:`mindspeed_mm.diffusion.sampler.decode_latents`
gives for video latents).

- ``t2v_shapes``: the text-to-video demo's checker (:func:`mindspeed_mm.demos.t2v.score_videos`), per sample:
  half for the dominant colour the caption names, half for the motion's direction (each 0 or 1).
- ``t2v_motion``: a dense direction score in [-1, 1] (:func:`motion_score`): how far the foreground's centroid
  travels from the first frame to the last along the caption's direction, over the demo clip's travel. A
  rule reward for the motion that the demo's SFT does not learn (docs/mm/dit.md).
- ``video_brightness``: the mean pixel of every frame, averaged over the frames (the loop's CI check).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindspeed_mm.demos.t2v import DIRECTIONS, NUM_FRAMES, STEP, score_videos
from mindspeed_rl.rewards.image import IMAGE_REWARDS, ImageReward


def _check(videos: torch.Tensor, captions: Sequence[str]) -> None:
    if videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"videos of shape {tuple(videos.shape)}: a video reward takes [N, F, 3, H, W] pixels")
    if videos.shape[0] != len(captions):
        raise ValueError(f"{videos.shape[0]} videos but {len(captions)} captions: give one caption a video")


@IMAGE_REWARDS.register("t2v_shapes")
def t2v_shapes_reward(colour_weight: float = 0.5, direction_weight: float = 0.5) -> ImageReward:
    """The text-to-video demo's colour and direction checks, weighted (each 0 or 1 a video)."""

    def score(videos: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
        _check(videos, captions)
        rows = [score_videos(video[None], [text]) for video, text in zip(videos, captions)]
        return torch.tensor([colour_weight * r["colour"] + direction_weight * r["direction"] for r in rows])

    return score


def motion_score(
    videos: torch.Tensor, captions: Sequence[str], threshold: float = 0.35, travel: float = STEP * (NUM_FRAMES - 1)
) -> torch.Tensor:
    """``[N]`` in [-1, 1]: the displacement of the foreground centroid (pixels whose brightest channel is above
    ``threshold``, weighted by how far above) from the first frame to the last, projected on the caption's
    direction (its last word, one of ``left right up down``) and divided by ``travel`` (the demo's 12 pixels),
    clamped. A frame without foreground gives 0 for the video."""
    _check(videos, captions)
    videos = videos.float()
    height, width = videos.shape[-2:]
    weight = (videos.amax(2) - threshold).clamp_min(0)  # [N, F, H, W]
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    mass = weight.sum((2, 3))
    cx = (weight * xs.to(weight)).sum((2, 3)) / mass.clamp_min(1e-6)
    cy = (weight * ys.to(weight)).sum((2, 3)) / mass.clamp_min(1e-6)
    out = []
    for i, text in enumerate(captions):
        word = text.split()[-1] if text.split() else ""
        if word not in DIRECTIONS:
            raise ValueError(f"caption {text!r} does not end in a direction ({', '.join(DIRECTIONS)})")
        dx, dy = DIRECTIONS[word]
        if bool((mass[i, [0, -1]] <= 0).any()):
            out.append(torch.zeros(()))
            continue
        moved = dx * (cx[i, -1] - cx[i, 0]) + dy * (cy[i, -1] - cy[i, 0])
        out.append((moved / travel).clamp(-1, 1))
    return torch.stack(out)


@IMAGE_REWARDS.register("t2v_motion")
def t2v_motion_reward(threshold: float = 0.35) -> ImageReward:
    """:func:`motion_score`: the foreground's travel along the caption's direction, in [-1, 1]."""

    def score(videos: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
        return motion_score(videos, captions, threshold).cpu()

    return score


@IMAGE_REWARDS.register("video_brightness")
def video_brightness_reward() -> ImageReward:
    """The mean over the frames of each frame's mean pixel (the loop's direction check on video)."""

    def score(videos: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
        _check(videos, captions)
        return videos.float().mean((2, 3, 4)).mean(1).cpu()

    return score
