"""Flow matching for training diffusion transformers: the timestep grid, sampling, noising, target and loss weights."""

from mindspeed_mm.diffusion.flow_matching import FlowDraw, FlowMatching, sample_density, sigma_grid

__all__ = ["FlowDraw", "FlowMatching", "sample_density", "sigma_grid"]
