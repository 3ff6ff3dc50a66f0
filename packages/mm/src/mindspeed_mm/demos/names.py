"""The embedded demos by name: ``demo`` (the vision-language demo: a tiny Qwen2.5-VL and its image
questions, ``demo-heldout`` its held-out set), ``demo-t2v`` (Wan text-to-video), ``demo-t2i`` (FLUX
text-to-image), ``demo-i2v`` (Wan image-to-video; its held-out first frames are ``i2v_paths()["images"]``) and
``demo-t2v-long`` (a Wan on long random latents, for sequence parallelism's memory;
training only).

A recipe's ``model.path`` / ``data.files`` / ``data.valid_files`` / ``data.features``, ``generate``'s
``--load-dir``, ``--base-dir``, ``--pipeline-dir`` and ``--prompts-file``, and ``evaluate``'s
``--load-dir``, ``--base-dir`` and ``--task-data-path`` may name a demo; the command-line entry points
call these functions, which replace the name by the demo's files (built once on first use under
``runs/mm-demo``): its model, transformer, data, feature cache, pipeline directory, held-out captions
or held-out questions. The library below (trainer, inference, evaluation) knows no demo names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mindspeed_mm.config import MMConfig
from mindspeed_mm.demos import vlm
from mindspeed_mm.demos.i2v import I2V, i2v_paths
from mindspeed_mm.demos.mmbench import DEMO_TASK, demo_mmbench_tsv
from mindspeed_mm.demos.t2i import T2I, t2i_paths
from mindspeed_mm.demos.t2v import T2V, demo_paths
from mindspeed_mm.demos.t2v_long import T2V_LONG, long_demo_paths
from mindspeed_mm.evaluation.config import EvaluateConfig

#: demo name -> the function that builds it once and returns its paths
#: (``{"pipeline", "transformer", "features", "heldout"}``).
DEMO_BUILDERS = {T2V: demo_paths, T2I: t2i_paths, I2V: i2v_paths}
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


def resolve_model_dir(path: str | None) -> str | None:
    """``path``, or the vision-language demo's model directory (built on first use) when ``path`` is ``demo``."""
    return str(vlm.demo_paths()["model"]) if path is not None and str(path) == vlm.DEMO else path


def resolve_evaluate_demo(config: EvaluateConfig) -> EvaluateConfig:
    """``evaluate``'s ``--load-dir`` / ``--base-dir demo`` and ``--task-data-path demo`` replaced by the demo's model
    and its held-out questions as an MMBench-style TSV (named ``demo.tsv``: the task keeps the name ``demo``)."""
    return dataclasses.replace(
        config,
        load_dir=resolve_model_dir(config.load_dir),
        base_dir=resolve_model_dir(config.base_dir),
        task_data_path=[str(demo_mmbench_tsv()) if name == DEMO_TASK else name for name in config.task_data_path],
    )


def resolve_demo(config: MMConfig) -> MMConfig:
    """``model.path: demo`` and ``data.files`` / ``data.valid_files: [demo | demo-heldout]`` replaced by the demo's
    paths, and the diffusion demos' names by theirs (:func:`resolve_dit_demo`); each built on first use."""
    config = resolve_dit_demo(config)  # demo-t2v / demo-t2i: the diffusion demos
    names = (vlm.DEMO, vlm.HELDOUT)
    if config.model.path != vlm.DEMO and not any(f in names for f in config.data.files + config.data.valid_files):
        return config
    paths = vlm.demo_paths()
    files = {vlm.DEMO: str(paths["train"]), vlm.HELDOUT: str(paths["heldout"])}
    model = dataclasses.replace(
        config.model, path=str(paths["model"]) if config.model.path == vlm.DEMO else config.model.path
    )
    data = dataclasses.replace(
        config.data,
        files=[files.get(f, f) for f in config.data.files],
        valid_files=[files.get(f, f) for f in config.data.valid_files],
    )
    return dataclasses.replace(config, model=model, data=data)


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
