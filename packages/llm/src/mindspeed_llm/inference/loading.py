"""Open a checkpoint for inference: a Hugging Face directory or a Megatron checkpoint of any layout.

Both go through convert-ckpt's sources (:mod:`mindspeed_llm.checkpoint.endpoints`,
:mod:`mindspeed_llm.checkpoint.megatron_dist`): the family's bridge plans the mapping (every
tensor matched and shape-checked before one is read), and each task yields one unsharded
megatron tensor (Hugging Face tensors fused by the bridge's rule, or a Megatron checkpoint's
TP/PP/EP pieces glued back), which is copied into the decoder. Nothing is written to disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_llm.bridges import Bridge, ModelShape, plan_conversion
from mindspeed_llm.checkpoint.endpoints import HFSource, MegatronSource, load_auto_config
from mindspeed_llm.checkpoint.megatron_dist import DistSource, is_dist_checkpoint
from mindspeed_llm.checkpoint.megatron_legacy import TRACKER
from mindspeed_llm.inference.weights import copy_checked
from mindspeed_llm.tokenizer import load_tokenizer

logger = get_logger(__name__)

#: Files that make a directory a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: ``--dtype`` names.
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``torch.dtype`` of a name (``None`` stays ``None``: the checkpoint's own dtype).

    Raises:
        ValueError: an unknown name.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[str(dtype)]


@dataclass
class OpenedCheckpoint:
    """A checkpoint ready to be read into a decoder.

    Attributes:
        path: the checkpoint directory.
        kind: ``"hf"`` or ``"mg"``.
        bridge: the family's bridge.
        shape: the model (``params_dtype`` is the weights' dtype).
        config: the transformers config of the model.
        assets: the directory holding config, tokenizer and generation files (``None``: none found).
        source: the convert-ckpt source that reads the tensors.
        description: one line for logs.
    """

    path: Path
    kind: str
    bridge: Bridge
    shape: ModelShape
    config: Any
    assets: Path | None
    source: Any
    description: str

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Copy every weight into ``targets`` (megatron name -> tensor), one tensor in memory at a time.

        Raises:
            ValueError: the checkpoint does not match the model (leftover or missing tensors, shapes).
        """
        plan = plan_conversion(self.bridge, self.shape, self.source.hf_shapes())
        for task in plan.tasks:
            copy_checked(targets[task.mg_name], self.source.read(task, plan), task.mg_name)

    def tokenizer(self) -> Any:
        """The transformers tokenizer of the assets directory, or ``None`` when it has none."""
        if self.assets is None or not any((self.assets / name).is_file() for name in TOKENIZER_FILES):
            return None

        return load_tokenizer(self.assets)

    def generation_config(self) -> dict[str, Any]:
        """``generation_config.json`` of the assets directory (empty when there is none)."""
        path = self.assets / "generation_config.json" if self.assets else None
        return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _hf_config(directory: Path) -> Any:
    return load_auto_config(directory)


def is_hf_directory(path: Path) -> bool:
    """A ``config.json`` next to safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def open_checkpoint(
    path: str | Path, hf_cfg_dir: str | Path | None = None, family: str | None = None
) -> OpenedCheckpoint:
    """Open ``path`` (Hugging Face directory or Megatron checkpoint) for inference.

    Args:
        path: the checkpoint directory.
        hf_cfg_dir: a directory with the model's ``config.json`` and tokenizer files; for a
            Megatron checkpoint it replaces the ``hf_config`` folder that convert-ckpt leaves in it.
        family: ``--model-type-hf`` override (MindSpeed-LLM's family names).

    Raises:
        ValueError: a missing directory, a directory that is neither format, an unsupported
            family, or tensors that do not match the model.
    """
    path = Path(path)
    cfg_dir = Path(hf_cfg_dir) if hf_cfg_dir is not None else None
    if not path.is_dir():
        raise ValueError(f"--load-dir {path} is not a directory")
    if cfg_dir is not None and not (cfg_dir / "config.json").is_file():
        raise ValueError(f"--hf-cfg-dir {cfg_dir} has no config.json")
    if is_hf_directory(path):
        source = HFSource(path, family)
        return OpenedCheckpoint(
            path, "hf", source.bridge, source.shape, _hf_config(path), cfg_dir or path, source, source.describe()
        )
    if not (path / TRACKER).is_file():
        raise ValueError(
            f"--load-dir {path} is neither a Hugging Face directory (config.json + *.safetensors) nor a "
            f"Megatron checkpoint ({TRACKER})"
        )
    try:
        source = (DistSource if is_dist_checkpoint(path) else MegatronSource)(path, family, cfg_dir)
    except KeyError as err:  # a dist checkpoint whose common state records no megatron args
        if err.args != ("args",):
            raise
        raise ValueError(
            f"{path} records no model args (another trainer's checkpoint?): load the Hugging Face export of the "
            "run instead (checkpoint.save_hf), or convert-ckpt output"
        ) from None
    assets = source.assets
    config = _hf_config(assets) if assets is not None else source.bridge.hf_config_from_shape(source.shape)
    if assets is None:
        logger.warning(
            "%s has no config.json (hf_config/ or --hf-cfg-dir): using one derived from its args, and no tokenizer",
            path,
        )
    return OpenedCheckpoint(path, "mg", source.bridge, source.shape, config, assets, source, source.describe())
