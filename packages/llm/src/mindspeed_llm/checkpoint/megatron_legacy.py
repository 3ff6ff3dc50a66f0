"""Megatron's per-rank checkpoint format (``--ckpt-format torch``), written and read by rank.

Layout on disk, as Megatron-LM and MindSpeed-LLM save and load it::

    <dir>/latest_checkpointed_iteration.txt          "1"
    <dir>/iter_0000001/mp_rank_<tp:02>[_<pp:03>][_<ep:03>]/model_optim_rng.pt

The pipeline index is in the name only when PP > 1, the expert index only when EP > 1. Each
file is a ``torch.save`` dict: ``args`` (an ``argparse.Namespace`` recording the model and the
layout), ``checkpoint_version`` 3.0, ``iteration``, and ``model`` (or ``model0``, ``model1`` ...
with virtual pipeline stages) holding that rank's local state dict, including the ``None``
``_extra_state`` entries megatron's linear layers save.
"""

from __future__ import annotations

import argparse
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from mindspeed.checkpointing.blocks import Blocks
from mindspeed.megatron.config import expert_tensor_parallel_size
from mindspeed_llm.bridges.layout import ParallelLayout, RankKey
from mindspeed_llm.bridges.megatron_params import has_extra_state
from mindspeed_llm.bridges.shape import ModelShape
from mindspeed_llm.checkpoint.torch_files import LazyTensor, LazyTorchFile, StoredTensor, StreamingTorchWriter, describe

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: A rank's entries: (model chunk, local name) in writing order.
Entries = list[tuple[int, str]]


def iteration_dir(iteration: int | str) -> str:
    """``iter_0000001`` (or ``release``)."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir(rank: RankKey, layout: ParallelLayout) -> str:
    """``mp_rank_XX[_YYY][_ZZZ]`` of ``rank`` (megatron's ``get_checkpoint_name``)."""
    name = f"mp_rank_{rank.tp:02d}"
    if layout.pp > 1:
        name += f"_{rank.pp:03d}"
    if layout.ep > 1:
        name += f"_{rank.ep:03d}"
    return name


def model_keys(num_chunks: int) -> list[str]:
    """The state-dict keys of the model chunks: ``model``, or ``model0`` ... with VPP."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def checkpoint_args(
    shape: ModelShape,
    layout: ParallelLayout,
    family: str,
    architecture: str,
    padded_vocab_size: int,
    iteration: int = 1,
) -> argparse.Namespace:
    """The ``args`` a converted checkpoint records (megatron's argument names).

    Args:
        shape: the model.
        layout: the layout written.
        family: the bridge family (``--model-type-hf``).
        architecture: the Hugging Face architecture.
        padded_vocab_size: embedding rows in megatron.
        iteration: the checkpoint's iteration.
    """
    args = shape.to_args()
    args.update(
        params_dtype=_DTYPES[shape.params_dtype],
        padded_vocab_size=padded_vocab_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=expert_tensor_parallel_size(shape, None) or layout.tp,
        num_layers_per_virtual_pipeline_stage=layout.vpp_layers,
        virtual_pipeline_model_parallel_size=layout.num_chunks(shape) if layout.vpp_layers else None,
        num_layer_list=",".join(map(str, layout.num_layer_list)) if layout.num_layer_list else None,
        model_type_hf=family,
        hf_architecture=architecture,
        iteration=iteration,
        ckpt_format="torch",
        use_mcore_models=True,
        transformer_impl="local",
        make_vocab_size_divisible_by=1,
    )
    return argparse.Namespace(**args)


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    """The parallel layout a checkpoint's ``args`` record."""
    layer_list = getattr(args, "num_layer_list", None)
    if isinstance(layer_list, str):
        layer_list = tuple(int(x) for x in layer_list.split(",") if x.strip())
    return ParallelLayout(
        tp=getattr(args, "tensor_model_parallel_size", 1) or 1,
        pp=getattr(args, "pipeline_model_parallel_size", 1) or 1,
        ep=getattr(args, "expert_model_parallel_size", 1) or 1,
        vpp_layers=getattr(args, "num_layers_per_virtual_pipeline_stage", None),
        num_layer_list=tuple(layer_list) if layer_list else None,
    )


class LegacyCheckpointReader:
    """A per-rank Megatron checkpoint, opened lazily (tensors are read on demand).

    Args:
        path: the checkpoint directory (with ``latest_checkpointed_iteration.txt``).

    Raises:
        ValueError: no tracker, a missing iteration directory, rank directories that do not
            match the layout the args record, or an unreadable rank file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        tracker = self.path / TRACKER
        if not tracker.is_file():
            raise ValueError(f"{self.path} is not a Megatron checkpoint: it has no {TRACKER}")
        text = tracker.read_text().strip()
        self.iteration: int | str = "release" if text == "release" else int(text)
        self.iter_path = self.path / iteration_dir(self.iteration)
        if not self.iter_path.is_dir():
            raise ValueError(f"{tracker} names iteration {text}, but {self.iter_path} does not exist")
        dirs = sorted(p.name for p in self.iter_path.iterdir() if _RANK_DIR.match(p.name))
        if not dirs:
            raise ValueError(f"{self.iter_path} holds no mp_rank_* directories")
        first = self._open(self.iter_path / dirs[0])
        if "args" not in first.obj:
            raise ValueError(f"{first.path} records no args; it was not saved by Megatron or mindspeed-llm")
        if not isinstance(first.obj["args"], argparse.Namespace):
            raise ValueError(
                f"{first.path} holds {describe(first.obj['args'])} as its args, not Megatron's; "
                "it was not saved by Megatron or mindspeed-llm"
            )
        self.args: argparse.Namespace = first.obj["args"]
        self.layout = layout_from_args(self.args)
        expected = {rank_dir(rank, self.layout): rank for rank in self.layout.ranks()}
        if set(dirs) != set(expected):
            missing, extra = sorted(set(expected) - set(dirs)), sorted(set(dirs) - set(expected))
            raise ValueError(
                f"{self.iter_path} does not match the layout in its args ({self.layout.describe()}): "
                f"missing {missing or 'none'}, unexpected {extra or 'none'}"
            )
        self._files: dict[RankKey, LazyTorchFile] = {expected[dirs[0]]: first}
        self._dirs = expected

    def _open(self, directory: Path) -> LazyTorchFile:
        file = directory / MODEL_FILE
        if not file.is_file():
            raise ValueError(f"{directory} has no {MODEL_FILE}")
        opened = LazyTorchFile(file)  # unknown classes stay inert placeholders: nothing in the file runs
        if not isinstance(opened.obj, dict):
            raise ValueError(
                f"{file} holds {describe(opened.obj)}, not a Megatron checkpoint's dict; "
                "it was not saved by Megatron or mindspeed-llm"
            )
        for key, state in opened.obj.items():  # the model chunks: tensors (and extra states) only
            if not (isinstance(key, str) and key.startswith("model")):
                continue
            wrong = (
                [(key, state, "a state dict")]
                if not isinstance(state, dict)
                else [
                    (f"{key}.{name}", value, "a tensor")
                    for name, value in state.items()
                    if value is not None and not isinstance(value, LazyTensor) and not name.endswith("_extra_state")
                ]
            )
            if wrong:
                where, value, expected = wrong[0]
                raise ValueError(
                    f"{file}: {where} holds {describe(value)}, not {expected}; "
                    "it was not saved by Megatron or mindspeed-llm"
                )
        return opened

    def file(self, rank: RankKey) -> LazyTorchFile:
        """The (lazily opened) file of ``rank``."""
        if rank not in self._files:
            self._files[rank] = self._open(self.iter_path / rank_dir(rank, self.layout))
        return self._files[rank]

    def chunks(self, rank: RankKey, num_chunks: int) -> list[dict[str, Any]]:
        """The model-chunk state dicts of ``rank`` (values are :class:`LazyTensor` or ``None``).

        Raises:
            ValueError: the file lacks a ``model`` / ``modelN`` entry.
        """
        obj = self.file(rank).obj
        out = []
        for key in model_keys(num_chunks):
            if key not in obj:
                raise ValueError(
                    f"{self.file(rank).path} has no {key!r} entry (found {sorted(obj)}); "
                    "does its args' virtual pipeline setting match?"
                )
            out.append(obj[key])
        return out

    def tensor(self, rank: RankKey, chunk: int, name: str, num_chunks: int) -> LazyTensor:
        """One local tensor of ``rank``'s chunk."""
        return self.chunks(rank, num_chunks)[chunk][name]


class LegacyCheckpointWriter:
    """Write a per-rank checkpoint tensor by tensor; each rank file is finished as soon as its
    last tensor arrives.

    Args:
        path: the checkpoint directory to fill (the tracker is written by :meth:`finish`).
        layout: the layout written.
        shape: the model.
        args: the ``args`` every rank records.
        entries: per rank, the (chunk, local name) of every tensor it will receive.
        iteration: the checkpoint's iteration.
    """

    def __init__(
        self,
        path: str | Path,
        layout: ParallelLayout,
        shape: ModelShape,
        args: argparse.Namespace,
        entries: dict[RankKey, Entries],
        iteration: int = 1,
    ) -> None:
        self.path, self.layout, self.shape, self.args, self.iteration = Path(path), layout, shape, args, iteration
        self.entries = entries
        self._remaining = {rank: set(items) for rank, items in entries.items()}
        self._stored: dict[RankKey, dict[tuple[int, str], StoredTensor]] = {rank: {} for rank in entries}
        self._writers: dict[RankKey, StreamingTorchWriter] = {}
        self.completed: list[RankKey] = []

    def file_path(self, rank: RankKey) -> Path:
        """Where ``rank``'s file goes."""
        return self.path / iteration_dir(self.iteration) / rank_dir(rank, self.layout) / MODEL_FILE

    def write(self, rank: RankKey, chunk: int, name: str, tensor: torch.Tensor | Blocks) -> bool:
        """Write one local tensor (or the views it is made of); returns True when it completed
        (and closed) the rank's file.

        Raises:
            ValueError: the tensor was not planned for this rank or was written twice.
        """
        key = (chunk, name)
        if key not in self._remaining.get(rank, ()):
            raise ValueError(f"{name} (chunk {chunk}) is not a pending tensor of rank {tuple(rank)}")
        writer = self._writers.get(rank)
        if writer is None:
            self.file_path(rank).parent.mkdir(parents=True, exist_ok=True)
            writer = self._writers[rank] = StreamingTorchWriter(self.file_path(rank))
        self._stored[rank][key] = writer.add(tensor)
        self._remaining[rank].discard(key)
        if self._remaining[rank]:
            return False
        writer.close(self._state(rank))
        del self._writers[rank], self._stored[rank]
        self.completed.append(rank)
        return True

    def _state(self, rank: RankKey) -> dict[str, Any]:
        num_chunks = self.layout.num_chunks(self.shape)
        models = [OrderedDict() for _ in range(num_chunks)]
        for chunk, name in self.entries[rank]:
            models[chunk][name] = self._stored[rank][(chunk, name)]
            module = name.rsplit(".", 1)[0]
            if has_extra_state(module):
                models[chunk][f"{module}._extra_state"] = None
        stage, chunk = self.layout.last_stage(self.shape)
        if rank.pp == stage:
            # The output layer module exists on the last stage even when tied (no weight of its own).
            models[chunk]["output_layer._extra_state"] = None
        state: dict[str, Any] = {
            "args": self.args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": self.iteration,
        }
        state.update(zip(model_keys(num_chunks), models))
        return state

    def finish(self) -> None:
        """Write the tracker; every rank must be complete."""
        pending = [tuple(rank) for rank, left in self._remaining.items() if left]
        if pending:
            raise ValueError(f"ranks {pending} never received all their tensors")
        (self.path / TRACKER).write_text(f"{self.iteration}\n")

    def abort(self) -> None:
        """Close the open files unfinished (the caller removes the directory)."""
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()
