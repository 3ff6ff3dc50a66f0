"""The scene both drawing demos share: held-out combinations that cover each colour and place twice, and the
palette that names a drawn colour back."""

from __future__ import annotations

import random
from collections import Counter

import torch

from mindspeed_mm.demos import t2i, t2v
from mindspeed_mm.demos.scene import COLOURS, palette_name


def test_each_demo_holds_out_every_colour_and_place_twice_and_names_its_colours_back() -> None:
    for held, places in ((t2i.heldout_combinations(), t2i.POSITIONS), (t2v.heldout_combinations(), t2v.DIRECTIONS)):
        assert len(set(held)) == 8
        assert Counter(c for c, _, _ in held) == dict.fromkeys(COLOURS, 2)
        assert Counter(p for _, _, p in held) == dict.fromkeys(places, 2)
    assert t2i.heldout_combinations()[0] == ("red", "square", "top right")  # the demos' held-out sets as before
    assert t2v.heldout_combinations()[0] == ("red", "square", "left")
    for name, rgb in COLOURS.items():
        assert palette_name(torch.tensor(rgb, dtype=torch.float32) / 255) == name
    image = t2i.draw_image("blue", "circle", "bottom left", random.Random(0))
    foreground = image.reshape(-1, 3)[image.reshape(-1, 3).max(axis=1) > 90]
    assert (foreground == COLOURS["blue"]).all() and len(foreground) > 40  # one shape of the named colour
