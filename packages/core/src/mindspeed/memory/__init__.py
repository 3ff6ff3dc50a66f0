"""The memory half of MindSpeed: recompute, swap and fp32-master reuse for megatron-core models.

Each technique is a plain function or wrapper here, applied to a built model or optimizer; the
features of :mod:`mindspeed.features.memory` attach them through the trainers' hooks
(``post_model_build``, ``post_optimizer_build``). Importing this package changes nothing.

- :mod:`~mindspeed.memory.recompute`: output-discarding recompute of the MLP activation and of
  the norms (``--recompute-activation-function``, ``--recompute-norm``).
"""
