"""The memory half of MindSpeed: recompute, swap and fp32-master reuse for megatron-core models.

Each technique is a plain function or wrapper here, applied to a built model or optimizer; the
features of :mod:`mindspeed.features.memory` attach them through the trainers' hooks
(``post_model_build``, ``post_optimizer_build``). Importing this package changes nothing.

- :mod:`~mindspeed.memory.recompute`: output-discarding recompute of the MLP activation and of
  the norms (``--recompute-activation-function``, ``--recompute-norm``).
- :mod:`~mindspeed.memory.swap_attention`: saved activations of attention and its norms to host
  memory in the forward, prefetched a layer ahead in the backward (``--swap-attention``).
- :mod:`~mindspeed.memory.fp32_reuse`: fp32 masters kept as bf16 weight + int16 remainder
  between steps (``--reuse-fp32-param``).
- :mod:`~mindspeed.memory.swap_optimizer`: the distributed optimizer's fp32 state in host
  memory, streamed through the device at the step (``--swap-optimizer``).
- :mod:`~mindspeed.memory.optimizer_step`: what the two share: megatron's optimizer step run
  chunk by chunk over its (main, model) parameter pairs.
"""
