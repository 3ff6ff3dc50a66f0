"""mindspeed_mm: vision-language models and diffusion transformers, trained with FSDP2 on the core.

The package is layered. Each folder (or top-level module) stands on a floor and imports only what
stands on lower floors, in module-level and function-level imports alike, so no two folders import
each other, directly or round a loop (tests/sanity/test_mm_layers.py reads this table and holds the
imports to it):

    floor 11  cli
    floor 10  train_cli, generate_cli, evaluate_cli, convert_cli, extract_cli
    floor  9  dit_generate
    floor  8  demos
    floor  7  evaluation
    floor  6  inference
    floor  5  convert
    floor  4  trainer, testing
    floor  3  data, diffusion
    floor  2  models
    floor  1  config

config holds the recipe's typed sections; models the families (one manifest, by name), LoRA and its
file formats, attention and parallel plans; data reads, encodes and caches samples; diffusion is
flow matching, the sampler and the demo's VAE; trainer trains and writes checkpoints; convert and
inference read them; evaluation scores inference; demos write tiny models and data and check them;
the entry points parse flags, resolve demo names and call the rest.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mindspeed-mm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
