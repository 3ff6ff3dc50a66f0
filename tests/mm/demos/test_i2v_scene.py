"""The image-to-video demo's data and score: held-out combinations covering each colour and direction twice, starts
that say nothing of the direction, and a score that gives the drawn clips full marks and reversed ones none."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import torch

from mindspeed_mm.demos import i2v
from mindspeed_mm.demos.scene import COLOURS


def test_heldout_covers_each_colour_and_direction_twice() -> None:
    held = i2v.heldout_combinations()
    assert len(set(held)) == 8
    assert Counter(c for c, _, _ in held) == dict.fromkeys(COLOURS, 2)
    assert Counter(d for _, _, d in held) == dict.fromkeys(i2v.DIRECTIONS, 2)


def test_starts_do_not_tell_the_direction_and_the_score_reads_the_motion() -> None:
    rng = random.Random(0)
    starts = {d: set() for d in i2v.DIRECTIONS}
    for direction in i2v.DIRECTIONS:
        for _ in range(300):
            first = i2v.draw_clip("red", "square", direction, rng)[0]
            ys, xs = np.nonzero(first.max(axis=-1) > 90)
            starts[direction].add((int(xs.min()), int(ys.min())))
    assert all(s == starts["left"] for s in starts.values())  # the same starts for every direction
    drawn = i2v.heldout_first_frames(seeds=2)
    clips = torch.from_numpy(np.stack([clip for _, clip in drawn])).permute(0, 1, 4, 2, 3).float() / 255
    firsts = [clip[0] for _, clip in drawn]
    captions = [i2v.caption(d) for (_, _, d), _ in drawn]
    colours = [c for (c, _, _), _ in drawn]
    assert i2v.score_clips(clips, firsts, captions, colours) == {"colour": 1.0, "direction": 1.0}
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    wrong = [i2v.caption(opposite[c.split()[-1]]) for c in captions]
    assert i2v.score_clips(clips, firsts, wrong, colours)["direction"] == 0.0
    still = clips[:, :1].expand_as(clips)  # the first frame copied: right colour, no motion
    assert i2v.score_clips(still, firsts, captions, colours) == {"colour": 1.0, "direction": 0.0}
