"""The two ends of a conversion: where full megatron tensors come from, and where they go.

A source yields, for every task of a :class:`~mindspeed_llm.bridges.engine.ConversionPlan`, the
unsharded megatron tensor (read from Hugging Face shards through the bridge's rule, or glued
together from a Megatron checkpoint's rank files); a sink takes it and writes it (cut into the
target layout's rank files, or turned back into Hugging Face tensors). Any source feeds any
sink, which gives hf -> mg, mg -> hf and mg -> mg with one loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from mindspeed.checkpointing.blocks import Blocks
from mindspeed.checkpointing.hf_dtype import main_dtype
from mindspeed.checkpointing.safetensors_io import HFCheckpoint, SafetensorsShardWriter
from mindspeed.log import get_logger
from mindspeed_llm.bridges import (
    Bridge,
    ModelShape,
    ParallelLayout,
    RankKey,
    bridge_for_architectures,
    bridge_for_family,
    megatron_params,
    merge_tensors,
    supported_models,
)
from mindspeed_llm.bridges.base import causal_architecture
from mindspeed_llm.bridges.engine import ConversionPlan, list_names
from mindspeed_llm.bridges.layout import merge_blocks, piece_shape, split_blocks
from mindspeed_llm.bridges.megatron_model import padded_vocab_size
from mindspeed_llm.bridges.megatron_params import MegatronParam, Split
from mindspeed_llm.bridges.rules import Task
from mindspeed_llm.bridges.stacked import StackedCheckpoint, StackingWriter, stacked_entries
from mindspeed_llm.checkpoint.megatron_legacy import (
    Entries,
    LegacyCheckpointReader,
    LegacyCheckpointWriter,
    checkpoint_args,
    rank_dir,
)

logger = get_logger(__name__)

#: Fields that decide tensor names and shapes; a config.json given for a Megatron checkpoint must agree on them.
_WEIGHT_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "untie_embeddings_and_output_weights",
    "add_qkv_bias",
    "qk_layernorm",
)


def read_hf_config(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` of ``directory``: the raw dict and transformers' normalised dict.

    Raises:
        ValueError: no ``config.json``.
    """
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no config.json")
    raw = json.loads(path.read_text())
    return raw, load_auto_config(directory, raw).to_dict()


def load_auto_config(directory: Path, raw: dict[str, Any] | None = None) -> Any:
    """transformers' config of ``directory`` (local files only).

    Raises:
        ValueError: a ``model_type`` transformers does not know, with the architectures the
            bridges support (not transformers' advice to upgrade it).
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw is None:
        raw = json.loads((directory / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in CONFIG_MAPPING:
        architectures = ", ".join(raw.get("architectures") or []) or "no architectures"
        raise ValueError(
            f"{directory / 'config.json'}: unsupported model_type {model_type!r} ({architectures}); "
            f"give a model of an architecture the suite converts ({supported_models(families=False)})"
        )
    return AutoConfig.from_pretrained(str(directory), local_files_only=True)


def pick_bridge(family: str | None, architectures: list[str] | None) -> Bridge:
    """``--model-type-hf`` when given, else the bridge of ``architectures``."""
    return bridge_for_family(family) if family else bridge_for_architectures(architectures)


def source_pieces(layout: ParallelLayout, param: MegatronParam, shape: ModelShape) -> list:
    """The pieces of ``param`` to read back from a checkpoint of ``layout``: one copy, from the
    first expert-parallel rank listed and the parameter's own stage (not the tied output layer's
    copy on the last stage), in tensor-parallel order."""
    placed = layout.place(param, shape)
    first = placed[0]
    own = [p for p in placed if p.rank.ep == first.rank.ep and (p.rank.pp, p.chunk) == (first.rank.pp, first.chunk)]
    return sorted(own, key=lambda p: p.tp_index)


class HFSource:
    """A Hugging Face checkpoint directory as a source.

    Args:
        path: the directory.
        family: ``--model-type-hf`` override (else ``config.json`` ``architectures`` decides).
        mtp_num_layers: multi-token-prediction layers to convert (``--mtp-num-layers``; default none).
    """

    kind = "hf"

    def __init__(self, path: Path, family: str | None = None, mtp_num_layers: int | None = None) -> None:
        self.path = path
        raw, config = read_hf_config(path)
        self.bridge = pick_bridge(family, raw.get("architectures"))
        known = [a for a in raw.get("architectures") or [] if causal_architecture(a) in self.bridge.hf_architectures]
        self.architecture = known[0] if known else self.bridge.hf_architectures[0]
        self.checkpoint = HFCheckpoint(path)
        if self.bridge.hf_stacks:  # experts stacked in one tensor (maybe MXFP4): seen one expert at a time
            self.checkpoint = StackedCheckpoint(self.checkpoint, self.bridge.hf_stacks)
        shape = self.bridge.shape_from_hf(config)
        # The weights' own dtype wins over config.json's (which may be stale or absent).
        by_dtype = collections.Counter()
        for info in self.checkpoint.tensors.values():
            by_dtype[info.dtype] += info.nbytes
        dtype = str(by_dtype.most_common(1)[0][0]).removeprefix("torch.") if by_dtype else shape.params_dtype
        self.shape = dataclasses.replace(shape, params_dtype=dtype)
        if mtp_num_layers is not None:
            self.shape = self.bridge.with_mtp_layers(self.shape, config, mtp_num_layers)
        self.assets = path

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor in the checkpoint."""
        return self.checkpoint.shapes()

    def dtypes(self, plan: ConversionPlan) -> dict[str, torch.dtype]:
        """Megatron name -> dtype of the tensor each task produces."""
        return {task.mg_name: self.checkpoint.tensors[task.hf_names[0]].dtype for task in plan.tasks}

    def check_copies(self, plan: ConversionPlan) -> None:
        """Every copy the checkpoint holds (``plan.hf_copies``) equals its original, bit for bit:
        megatron keeps one tensor for both, so a copy that differs cannot be converted.

        Raises:
            ValueError: a copy differs from its original.
        """
        for original, copies in plan.hf_copies.items():
            for copy in copies:
                if copy in self.checkpoint.tensors and not torch.equal(
                    self.checkpoint.read(copy), self.checkpoint.read(original)
                ):
                    raise ValueError(
                        f"{copy} differs from {original}; megatron shares one tensor for both, so this "
                        "checkpoint's multi-token-prediction layers cannot be converted (leave out "
                        "--mtp-num-layers to drop them)"
                    )

    def read(self, task: Task, plan: ConversionPlan) -> torch.Tensor:
        """The unsharded megatron tensor of ``task``."""
        return task.rule.to_megatron([self.checkpoint.read(name) for name in task.hf_names], plan.shape)

    def read_blocks(self, task: Task, plan: ConversionPlan) -> Blocks:
        """:meth:`read` as views of the mapped Hugging Face tensors (nothing copied)."""
        return task.rule.to_megatron_blocks([self.checkpoint.read(name) for name in task.hf_names], plan.shape)

    def describe(self) -> str:
        """One line for the report."""
        return f"hf {self.path} ({self.architecture}, {len(self.checkpoint.tensors)} tensors)"


def resolve_megatron_model(
    path: Path, args: Any, family: str | None, hf_cfg_dir: Path | None
) -> tuple[Bridge, str, ModelShape, Path | None]:
    """Bridge, architecture, model shape and Hugging Face asset directory of a Megatron checkpoint.

    The model comes from ``config.json`` when one is at hand (``--hf-cfg-dir``, else the
    ``hf_config`` folder a conversion from Hugging Face leaves), checked against the recorded
    args; otherwise from the args alone.

    Raises:
        ValueError: the family cannot be told, or the config describes another model than the args.
    """
    assets = hf_cfg_dir or (path / "hf_config" if (path / "hf_config" / "config.json").is_file() else None)
    raw, config = read_hf_config(assets) if assets else ({}, None)
    family = family or getattr(args, "model_type_hf", None)
    if not family and not raw.get("architectures"):
        raise ValueError(
            f"cannot tell the model family of {path}: pass --model-type-hf or --hf-cfg-dir with the model's config.json"
        )
    bridge = pick_bridge(family, raw.get("architectures"))
    architecture = getattr(args, "hf_architecture", None) or bridge.hf_architectures[0]
    if config is None:
        return bridge, architecture, ModelShape.from_args(args), assets
    # The multi-token-prediction layers the checkpoint holds are in its args, not in config.json.
    shape = dataclasses.replace(bridge.shape_from_hf(config), mtp_num_layers=getattr(args, "mtp_num_layers", None))
    if getattr(args, "num_labels", None):  # a score head trained on a language model's config
        shape = dataclasses.replace(shape, num_labels=args.num_labels)
    recorded = vars(args)
    differ = [
        f"{f} {getattr(shape, f)} vs {recorded[f]}"
        for f in _WEIGHT_FIELDS
        if recorded.get(f) is not None and recorded[f] != getattr(shape, f)
    ]
    if differ:
        raise ValueError(
            f"{assets / 'config.json'} describes another model than {path}'s args "
            f"(config vs checkpoint): {'; '.join(differ)}"
        )
    return bridge, architecture, shape, assets


class MegatronSource:
    """A per-rank Megatron checkpoint as a source; its layout comes from the recorded args.

    Args:
        path: the checkpoint directory.
        family: ``--model-type-hf`` override.
        hf_cfg_dir: a directory with the model's ``config.json`` (``--hf-cfg-dir``); by default the
            ``hf_config`` folder a conversion from Hugging Face leaves in the checkpoint.
    """

    kind = "mg"

    def __init__(self, path: Path, family: str | None = None, hf_cfg_dir: Path | None = None) -> None:
        self.path = path
        self.reader = LegacyCheckpointReader(path)
        self.layout: ParallelLayout = self.reader.layout
        self.bridge, self.architecture, shape, self.assets = resolve_megatron_model(
            path, self.reader.args, family, hf_cfg_dir
        )
        self.layout.check(shape)
        self.params = megatron_params(shape)
        self.pieces = {name: self._source_pieces(param, shape) for name, param in self.params.items()}
        first = self.pieces["embedding.word_embeddings.weight"][0]
        dtype = self.reader.tensor(first.rank, first.chunk, first.name, self.layout.num_chunks(shape)).dtype
        self.shape = dataclasses.replace(shape, params_dtype=str(dtype).removeprefix("torch."))
        self._check_files()

    def _source_pieces(self, param: MegatronParam, shape: ModelShape) -> list:
        return source_pieces(self.layout, param, shape)

    def _check_files(self) -> None:
        chunks = self.layout.num_chunks(self.shape)
        expected: dict[tuple[RankKey, int, str], MegatronParam] = {}
        for param in self.params.values():
            for piece in self.layout.place(param, self.shape):
                expected[(piece.rank, piece.chunk, piece.name)] = param
        found = set()
        for rank in self.layout.ranks():
            for chunk, state in enumerate(self.reader.chunks(rank, chunks)):
                for name, value in state.items():
                    if not name.endswith("._extra_state"):
                        found.add((rank, chunk, name))
                        param = expected.get((rank, chunk, name))
                        want = piece_shape(param, self.layout.tp) if param else None
                        got = tuple(value.shape)
                        if (
                            param is not None
                            and param.split is Split.VOCAB
                            and got[1:] == want[1:]
                            and got[0] >= want[0]
                        ):
                            continue  # a vocabulary padded further than TP needs (megatron's divisible-by 128)
                        if param is not None and got != want:
                            raise ValueError(
                                f"shape mismatch: {rank_dir(rank, self.layout)} {name} is "
                                f"{tuple(value.shape)}, the model implies {want}"
                            )

        def label(key: tuple) -> str:
            return f"{rank_dir(key[0], self.layout)}/{f'model{key[1]}:' if chunks > 1 else ''}{key[2]}"

        missing, extra = set(expected) - found, found - set(expected)
        if extra:
            raise ValueError(
                f"{self.path} holds tensors the {self.bridge.family} model does not have: "
                f"{list_names([label(k) for k in extra])}"
            )
        if missing:
            raise ValueError(
                f"{self.path} lacks tensors of the {self.bridge.family} model: "
                f"{list_names([label(k) for k in missing])}"
            )

    def hf_shapes(self) -> None:
        """No Hugging Face side to check."""
        return None

    def dtypes(self, plan: ConversionPlan) -> dict[str, torch.dtype]:
        """Megatron name -> dtype as stored."""
        chunks = self.layout.num_chunks(self.shape)
        return {
            name: self.reader.tensor(p[0].rank, p[0].chunk, p[0].name, chunks).dtype for name, p in self.pieces.items()
        }

    def read(self, task: Task, plan: ConversionPlan) -> torch.Tensor:
        """The unsharded tensor of ``task``, glued from its tensor-parallel pieces."""
        chunks = self.layout.num_chunks(self.shape)
        param = self.params[task.mg_name]
        lazy = [self.reader.tensor(p.rank, p.chunk, p.name, chunks) for p in self.pieces[task.mg_name]]
        if len(lazy) > 1 and param.split in (Split.COLUMN, Split.VOCAB, Split.GLU):
            return _glue_rows(param, lazy)
        return merge_tensors(param, [t.load() for t in lazy])

    def read_blocks(self, task: Task, plan: ConversionPlan) -> Blocks:
        """:meth:`read` as views of the mapped tensor-parallel pieces (nothing copied)."""
        chunks = self.layout.num_chunks(self.shape)
        pieces = [self.reader.tensor(p.rank, p.chunk, p.name, chunks).load() for p in self.pieces[task.mg_name]]
        return merge_blocks(self.params[task.mg_name], pieces)

    def describe(self) -> str:
        """One line for the report."""
        return f"mg {self.path} ({self.bridge.family}, {self.layout.describe()})"


def _glue_rows(param: MegatronParam, pieces: list) -> torch.Tensor:
    # Row-cut pieces read straight into their rows of one preallocated tensor: the same result
    # as merge_tensors, without a buffer per piece and a copy to glue them.
    rows = pieces[0].shape[0]
    full = torch.empty((rows * len(pieces), *pieces[0].shape[1:]), dtype=pieces[0].dtype)
    width = full[0].numel() if full.dim() > 1 else 1
    if param.split is Split.GLU:
        half, total = rows // 2, rows * len(pieces) // 2
        for index, piece in enumerate(pieces):  # [gate_r; up_r] -> gate rows and up rows
            piece.read_into(full[index * half : (index + 1) * half], 0)
            piece.read_into(full[total + index * half : total + (index + 1) * half], half * width)
    else:
        for index, piece in enumerate(pieces):
            piece.read_into(full[index * rows : (index + 1) * rows], 0)
    return full[: param.shape[0]] if param.split is Split.VOCAB else full


@dataclasses.dataclass
class OutputFile:
    """One planned output file: its relative path, tensor count and bytes."""

    path: str
    tensors: int = 0
    nbytes: int = 0


class MegatronSink:
    """Cuts every unsharded tensor into the target layout's rank files.

    Args:
        plan: the conversion plan.
        layout: the target layout (already checked).
        source: the source (for the family, architecture and dtypes).
    """

    def __init__(self, plan: ConversionPlan, layout: ParallelLayout, source: Any) -> None:
        self.plan, self.layout, self.shape = plan, layout, plan.shape
        dtypes = source.dtypes(plan)
        self.entries: dict[RankKey, Entries] = {rank: [] for rank in layout.ranks()}
        files = {
            rank: OutputFile(f"iter_0000001/{rank_dir(rank, layout)}/model_optim_rng.pt") for rank in layout.ranks()
        }
        for task in plan.tasks:
            param = plan.params[task.mg_name]
            nbytes = dtypes[task.mg_name].itemsize
            for dim in piece_shape(param, layout.tp):
                nbytes *= dim
            for piece in layout.place(param, self.shape):
                self.entries[piece.rank].append((piece.chunk, piece.name))
                files[piece.rank].tensors += 1
                files[piece.rank].nbytes += nbytes
        self.files = list(files.values())
        self.args = checkpoint_args(
            self.shape, layout, plan.bridge.family, source.architecture, padded_vocab_size(self.shape, layout)
        )
        self.writer: LegacyCheckpointWriter | None = None

    def open(self, directory: Path) -> None:
        """Start writing into ``directory``."""
        self.writer = LegacyCheckpointWriter(directory, self.layout, self.shape, self.args, self.entries)

    def put(self, task: Task, full: torch.Tensor | Blocks) -> None:
        """Write the pieces of one unsharded tensor (or of the views it is made of)."""
        param = self.plan.params[task.mg_name]
        pieces = split_blocks(param, full if isinstance(full, Blocks) else Blocks.of(full), self.layout.tp)
        for piece in self.layout.place(param, self.shape):
            self.writer.write(piece.rank, piece.chunk, piece.name, pieces[piece.tp_index])

    def finish(self) -> None:
        """Write the tracker."""
        self.writer.finish()

    def abort(self) -> None:
        """Close the open files (after a failure; the caller removes the directory)."""
        if self.writer is not None:
            self.writer.abort()

    def describe(self) -> str:
        """One line for the report."""
        return f"mg ({self.layout.describe()}, {len(self.files)} rank files)"


class HFSink:
    """Turns every unsharded tensor back into Hugging Face tensors in sharded safetensors.

    Args:
        plan: the conversion plan.
        source: the source (for dtypes).
        max_shard_bytes: safetensors shard size limit.
        dtype: write the floating-point tensors in this dtype (``None``: as the source holds them).
    """

    def __init__(
        self, plan: ConversionPlan, source: Any, max_shard_bytes: int, dtype: torch.dtype | None = None
    ) -> None:
        self.plan, self.max_shard_bytes, self.cast = plan, max_shard_bytes, dtype
        dtypes = {
            name: dtype if dtype is not None and held.is_floating_point else held
            for name, held in source.dtypes(plan).items()
        }
        self.tensors = []
        for task in plan.tasks:
            shapes = task.rule.hf_shapes(plan.params[task.mg_name].shape, plan.shape)
            for name, shape in zip(task.hf_names, shapes):
                self.tensors += [(copy, dtypes[task.mg_name], shape) for copy in [name, *plan.hf_copies.get(name, [])]]
        self.tensors, self.counts = stacked_entries(self.tensors, plan.bridge.hf_stacks)
        self.writer: SafetensorsShardWriter | None = None
        self.out: Any = None
        self.files = self._plan_files()

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of most of the written floating-point tensors (what ``config.json`` must say)."""
        numel = ((dtype, math.prod(shape)) for _, dtype, shape in self.tensors)
        return main_dtype(numel)

    def _plan_files(self) -> list[OutputFile]:
        # The same grouping the writer will do, without creating files (for --dry-run).
        files: list[OutputFile] = []
        size = 0
        for _, dtype, shape in self.tensors:
            nbytes = dtype.itemsize
            for dim in shape:
                nbytes *= dim
            if not files or (files[-1].tensors and size + nbytes > self.max_shard_bytes):
                files.append(OutputFile(""))
                size = 0
            files[-1].tensors += 1
            files[-1].nbytes += nbytes
            size += nbytes
        for number, file in enumerate(files, 1):
            file.path = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        return files

    def open(self, directory: Path) -> None:
        """Create the shards in ``directory``."""
        self.writer = SafetensorsShardWriter(directory, self.tensors, self.max_shard_bytes)
        self.out = StackingWriter(self.writer, self.plan.bridge.hf_stacks, self.counts)

    def put(self, task: Task, full: torch.Tensor | Blocks) -> None:
        """Write the Hugging Face tensors made of one unsharded tensor (or of the views it is made of)."""
        blocks = full if isinstance(full, Blocks) else Blocks.of(full)
        for name, tensor in zip(task.hf_names, task.rule.to_hf_blocks(blocks, self.plan.shape)):
            if self.cast is not None and tensor.dtype.is_floating_point and tensor.dtype != self.cast:
                tensor = Blocks.of(tensor.tensor().to(self.cast))  # noqa: PLW2901 -- the cast copy is what is written
            for copy in [name, *self.plan.hf_copies.get(name, [])]:
                self.out.write(copy, tensor)

    def finish(self) -> None:
        """Write the index."""
        self.writer.finish()

    def abort(self) -> None:
        """Close the open shards (after a failure; the caller removes the directory)."""
        if self.writer is not None:
            self.writer.abort()

    def describe(self) -> str:
        """One line for the report."""
        return f"hf ({len(self.files)} safetensors shards)"
