"""The embedded diffusion demos by name: ``demo-t2v`` (Wan text-to-video), ``demo-t2i`` (FLUX text-to-image) and
``demo-t2v-long`` (a Wan on long random latents, for sequence parallelism's memory; training only).

A recipe's ``model.path`` / ``data.features`` and ``generate``'s ``--load-dir``, ``--base-dir``,
``--pipeline-dir`` and ``--prompts-file`` may name a demo; these functions replace the name by the
demo's files (built once on first use under ``runs/mm-demo``): its transformer, feature cache,
pipeline directory or held-out captions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mindspeed_mm.config import MMConfig
from mindspeed_mm.diffusion.demo import T2V, demo_paths
from mindspeed_mm.diffusion.demo_long import T2V_LONG, long_demo_paths
from mindspeed_mm.diffusion.demo_t2i import T2I, t2i_paths

#: demo name -> the function that builds it once and returns its paths
#: (``{"pipeline", "transformer", "features", "heldout"}``).
DEMO_BUILDERS = {T2V: demo_paths, T2I: t2i_paths}
DEMOS = tuple(DEMO_BUILDERS)
#: demos a training recipe may name (``{"transformer", "features"}`` at least): the above and the long-video one.
TRAINING_BUILDERS = {**DEMO_BUILDERS, T2V_LONG: long_demo_paths}


def diffusion_demo_paths(name: str) -> dict[str, Path]:
    """The paths of demo ``name`` (built on first use)."""
    return DEMO_BUILDERS[name]()


def resolve_demo_dir(path: str | None) -> str | None:
    """``path``, or the demo's pipeline directory (built on first use) when ``path`` names a demo."""
    return str(diffusion_demo_paths(path)["pipeline"]) if path is not None and str(path) in DEMOS else path


def resolve_prompts_file(path: str) -> Path:
    """``path``, or the demo's held-out captions (one a line) when ``path`` names a demo."""
    return diffusion_demo_paths(path)["heldout"] if path in DEMOS else Path(path)


def resolve_dit_demo(config: MMConfig) -> MMConfig:
    """``model.path`` and ``data.features`` naming a demo replaced by its transformer / feature cache."""
    model_path, features = config.model.path, config.data.features
    if model_path not in TRAINING_BUILDERS and features not in TRAINING_BUILDERS:
        return config
    model = config.model
    if model_path in TRAINING_BUILDERS:
        model = dataclasses.replace(model, path=str(TRAINING_BUILDERS[model_path]()["transformer"]))
    data = config.data
    if features in TRAINING_BUILDERS:
        data = dataclasses.replace(data, features=str(TRAINING_BUILDERS[features]()["features"]))
    return dataclasses.replace(config, model=model, data=data)
