"""Diffusion maths and parts for diffusion transformers: flow matching for training (the timestep grid, sampling,
noising, target and loss weights), the sampler (:mod:`~mindspeed_mm.diffusion.sampler`), writing samples
(:mod:`~mindspeed_mm.diffusion.media`) and the demo's lossless VAE (:mod:`~mindspeed_mm.diffusion.patch_vae`).

Loading a pipeline from checkpoints is inference's (:mod:`mindspeed_mm.inference.dit_pipeline`); the demos are
in :mod:`mindspeed_mm.demos`.
"""

from mindspeed_mm.diffusion.flow_matching import FlowDraw, FlowMatching, sample_density, sigma_grid

__all__ = ["FlowDraw", "FlowMatching", "sample_density", "sigma_grid"]
