"""megatron-core's distributed checkpoint format (``--ckpt-format torch_dist``).

A dist checkpoint stores every tensor once with its global shape; megatron-core reshards it at
load time to whatever layout the loading run has. It is written and read here through
megatron-core itself (``dist_checkpointing.save`` / ``load`` on a ``GPTModel``'s
``sharded_state_dict()``), in this process, on one gloo rank of an in-memory store, so the
key names, the stacked layer axis and the split of gated MLP weights are exactly megatron's.

Cost: the unsharded model is held in memory once (the per-rank format streams instead).
The embedding is padded to the target layout's vocabulary size, which the args record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing.blocks import Blocks
from mindspeed.log import get_logger
from mindspeed.megatron import adapt, unadapt
from mindspeed.megatron.trusted_load import check_dist_checkpoint, trusted_dist_loads
from mindspeed_llm.bridges import ModelShape, ParallelLayout, megatron_params
from mindspeed_llm.bridges.engine import ConversionPlan
from mindspeed_llm.bridges.megatron_model import build_gpt_chunks, padded_vocab_size
from mindspeed_llm.bridges.megatron_params import Split, has_extra_state
from mindspeed_llm.bridges.rules import Task
from mindspeed_llm.checkpoint.endpoints import OutputFile, resolve_megatron_model
from mindspeed_llm.checkpoint.megatron_legacy import CHECKPOINT_VERSION, TRACKER, checkpoint_args, iteration_dir

logger = get_logger(__name__)

#: The file every dist checkpoint directory has.
METADATA = "metadata.json"


def is_dist_checkpoint(path: Path) -> bool:
    """Whether the Megatron checkpoint at ``path`` is in the dist format."""
    tracker = path / TRACKER
    if not tracker.is_file():
        return False
    text = tracker.read_text().strip()
    return (path / iteration_dir("release" if text == "release" else int(text)) / METADATA).is_file()


@contextmanager
def single_rank_megatron() -> Iterator[None]:
    """megatron-core ready in this process: one gloo rank (unless torch.distributed is already
    up), adapted to the CPU, parallel state at TP1 PP1; all undone on exit."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    adapt("cpu")
    try:
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(0)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
    finally:
        unadapt()
        if created:
            dist.destroy_process_group()


def _full_state_with_extras(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = dict(state)
    for name in state:
        module = name.rsplit(".", 1)[0]
        if has_extra_state(module):
            out[f"{module}._extra_state"] = None
    out["output_layer._extra_state"] = None
    return out


def save_dist_checkpoint(
    directory: Path, shape: ModelShape, args: Any, state: dict[str, torch.Tensor], vocab_size: int
) -> None:
    """Write the unsharded megatron ``state`` as a dist checkpoint under ``directory`` (tracker included)."""
    from megatron.core import dist_checkpointing

    iteration = getattr(args, "iteration", 1)
    target = directory / iteration_dir(iteration)
    target.mkdir(parents=True)
    with single_rank_megatron():
        (model,) = build_gpt_chunks(
            shape, ParallelLayout(), vocab_size=vocab_size, megatron_modules=True, perform_initialization=False
        )
        model.load_state_dict(_full_state_with_extras(state), strict=True)
        dist_checkpointing.save(
            {
                "args": args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration,
                "model": model.sharded_state_dict(),
            },
            str(target),
            async_sharded_save=False,
        )
    (directory / TRACKER).write_text(f"{iteration}\n")


class DistSource:
    """A megatron-core dist checkpoint as a source (read whole through megatron-core).

    Args:
        path: the checkpoint directory (with the tracker).
        family: ``--model-type-hf`` override.
        hf_cfg_dir: a directory with the model's ``config.json``.
    """

    kind = "mg"

    def __init__(self, path: Path, family: str | None = None, hf_cfg_dir: Path | None = None) -> None:
        from megatron.core import dist_checkpointing

        self.path = path
        text = (path / TRACKER).read_text().strip()
        directory = path / iteration_dir("release" if text == "release" else int(text))
        check_dist_checkpoint(directory)  # nothing in it runs code: a refused file is one line
        with trusted_dist_loads():
            args = dist_checkpointing.load_common_state_dict(str(directory))["args"]
        self.bridge, self.architecture, shape, self.assets = resolve_megatron_model(path, args, family, hf_cfg_dir)
        rows = getattr(args, "padded_vocab_size", None) or shape.vocab_size
        with single_rank_megatron():
            (model,) = build_gpt_chunks(
                shape, ParallelLayout(), vocab_size=rows, megatron_modules=True, perform_initialization=False
            )
            with trusted_dist_loads():
                loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
            model.load_state_dict(loaded["model"])
            state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
        params = megatron_params(shape)
        for name, param in params.items():
            if param.split is Split.VOCAB:
                state[name] = state[name][: param.shape[0]]
        missing, extra = set(params) - set(state), set(state) - set(params)
        if missing or extra:
            raise ValueError(
                f"{path}: the dist checkpoint does not match the {self.bridge.family} model "
                f"(missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]})"
            )
        self.state = state
        dtype = state["embedding.word_embeddings.weight"].dtype
        self.shape = dataclasses.replace(shape, params_dtype=str(dtype).removeprefix("torch."))

    def hf_shapes(self) -> None:
        """No Hugging Face side to check."""
        return None

    def dtypes(self, plan: ConversionPlan) -> dict[str, torch.dtype]:
        """Megatron name -> dtype."""
        return {name: tensor.dtype for name, tensor in self.state.items()}

    def read(self, task: Task, plan: ConversionPlan) -> torch.Tensor:
        """The unsharded tensor of ``task``."""
        return self.state[task.mg_name]

    def describe(self) -> str:
        """One line for the report."""
        return f"mg {self.path} ({self.bridge.family}, torch_dist)"


class DistSink:
    """Collects the unsharded tensors and writes them as a dist checkpoint at the end.

    Args:
        plan: the conversion plan.
        layout: the layout the args record (the checkpoint itself loads at any layout).
        source: the source (for the family and architecture).
    """

    def __init__(self, plan: ConversionPlan, layout: ParallelLayout, source: Any) -> None:
        self.plan, self.layout, self.shape = plan, layout, plan.shape
        self.rows = padded_vocab_size(self.shape, layout)
        self.args = checkpoint_args(self.shape, layout, plan.bridge.family, source.architecture, self.rows)
        self.args.ckpt_format = "torch_dist"
        dtypes = source.dtypes(plan)
        nbytes = 0
        for task in plan.tasks:
            count = dtypes[task.mg_name].itemsize
            for dim in plan.params[task.mg_name].shape:
                count *= dim
            nbytes += count
        self.files = [OutputFile(f"{iteration_dir(1)}/ (torch_dist, loads at any layout)", len(plan.tasks), nbytes)]
        self.state: dict[str, torch.Tensor] = {}
        self.directory: Path | None = None

    def open(self, directory: Path) -> None:
        """Start collecting; the checkpoint goes into ``directory``."""
        self.directory = directory

    def put(self, task: Task, full: torch.Tensor | Blocks) -> None:
        """Keep one unsharded tensor (embedding rows padded to the recorded vocabulary size)."""
        if isinstance(full, Blocks):
            full = full.tensor()
        if self.plan.params[task.mg_name].split is Split.VOCAB and full.shape[0] < self.rows:
            full = torch.cat([full, full.new_zeros((self.rows - full.shape[0], *full.shape[1:]))])
        self.state[task.mg_name] = full

    def finish(self) -> None:
        """Write the dist checkpoint."""
        save_dist_checkpoint(self.directory, self.shape, self.args, self.state, self.rows)
        self.state = {}

    def abort(self) -> None:
        """Drop what was collected."""
        self.state = {}

    def describe(self) -> str:
        """One line for the report."""
        return f"mg (torch_dist, args record {self.layout.describe()})"
