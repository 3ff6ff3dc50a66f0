"""``convert`` of a Wan2.2 two-expert checkpoint (``diffusion.expert=both``) into a pipeline's pair of folders.

The run's DCP checkpoint holds both experts under ``transformer.`` and ``transformer_2.`` (the
:class:`~mindspeed_mm.models.wan_experts.ExpertPair` module names). ``dcp -> hf`` with ``--base-dir
PIPE/transformer`` (the run's ``model.path``) writes ``SAVE/transformer/`` and ``SAVE/transformer_2/``
(each as for one transformer, against the configuration of the pipeline's folder of that name) and
``SAVE/model_index.json`` (the pipeline's, with ``boundary_ratio``): what ``checkpoint.save_hf`` of the run writes.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mindspeed.checkpointing.atomic import atomic_directory
from mindspeed_mm.models.wan_experts import EXPERT_FOLDERS, second_expert_path


class ExpertView:
    """One expert's tensors of a pair checkpoint (:class:`~mindspeed_mm.convert.dcp_io.DCPModel`'s interface,
    the ``folder.`` prefix taken off the names)."""

    def __init__(self, source: Any, folder: str) -> None:
        self.source, self.prefix = source, f"{folder}."
        self.path, self.has_ema = source.path, source.has_ema
        self.tensors = {n[len(self.prefix) :]: v for n, v in source.tensors.items() if n.startswith(self.prefix)}
        self.ema_names = {n[len(self.prefix) :]: v for n, v in source.ema_names.items() if n.startswith(self.prefix)}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` (the expert's own module names)."""
        return {n[len(self.prefix) :]: t for n, t in self.source.read([self.prefix + n for n in names]).items()}

    def batches(self, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """``names`` read in order, in the source's batches."""
        for batch in self.source.batches([self.prefix + n for n in names]):
            yield {n[len(self.prefix) :]: t for n, t in batch.items()}


def is_expert_pair(source: Any) -> bool:
    """Whether the checkpoint's tensors are a pair's: all under ``transformer.`` or ``transformer_2.``, both there."""
    prefixes = {name.split(".", 1)[0] for name in source.tensors}
    return prefixes == set(EXPERT_FOLDERS)


def dcp_pair_to_hf(config: Any, source: Any, one_to_hf: Callable[[Any, Any], Any]) -> Any:
    """Write both experts (``one_to_hf(config, source view)`` each) and the pipeline's ``model_index.json``.

    Raises:
        ValueError: ``--base-dir`` is not the ``transformer`` folder of a two-expert pipeline.
    """
    base = Path(config.base_dir)
    index = base.parent / "model_index.json"
    if base.name != EXPERT_FOLDERS[0] or not index.is_file():
        raise ValueError(
            f"{source.path} holds a Wan2.2 expert pair (diffusion.expert=both): give --base-dir as the run's "
            "model.path, the transformer folder of the pipeline (transformer/, transformer_2/ and model_index.json)"
        )
    bases = {EXPERT_FOLDERS[0]: base, EXPERT_FOLDERS[1]: second_expert_path(base)}
    report = None
    with atomic_directory(Path(config.save_dir)) as temp:
        for folder in EXPERT_FOLDERS:
            one = dataclasses.replace(config, save_dir=temp / folder, base_dir=bases[folder], overwrite=False)
            written = one_to_hf(one, ExpertView(source, folder))
            if report is None:
                report = written
            else:
                report.tensors += written.tensors
                report.nbytes += written.nbytes
        shutil.copyfile(index, temp / "model_index.json")
    report.source = f"{report.source} and its transformer_2 (Wan2.2 expert pair)"
    report.target = f"hf {config.save_dir} (transformer/, transformer_2/, model_index.json)"
    return report
