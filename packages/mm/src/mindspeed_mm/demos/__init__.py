"""The embedded demos: tiny models and synthetic data that learn in minutes on a CPU, and their checks.

- :mod:`~mindspeed_mm.demos.vlm`: ``demo``, a tiny Qwen2.5-VL naming colours and shapes in images;
  :mod:`~mindspeed_mm.demos.mmbench`: its held-out questions as an MMBench-style TSV for ``evaluate``;
- :mod:`~mindspeed_mm.demos.t2v`: ``demo-t2v``, a tiny Wan drawing moving shapes;
  :mod:`~mindspeed_mm.demos.t2v_long`: ``demo-t2v-long``, long random latents for sequence parallelism's memory;
- :mod:`~mindspeed_mm.demos.t2i`: ``demo-t2i``, a tiny FLUX drawing shapes in corners;
- :mod:`~mindspeed_mm.demos.i2v`: ``demo-i2v``, a tiny Wan I2V moving a given first frame's shape;
- :mod:`~mindspeed_mm.demos.scene`: what the drawing demos share (the coloured shapes, the
  held-out combinations, the cache they are built into once, sampling the held-out captions);
- :mod:`~mindspeed_mm.demos.names`: the names above, resolved to their files by the command-line entry points.

The demos stand above the library (they write data, train-free models and score samples with it);
nothing below them imports them.
"""
