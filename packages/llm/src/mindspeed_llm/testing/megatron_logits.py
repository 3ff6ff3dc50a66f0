"""Load a converted Megatron checkpoint into megatron-core on this rank and compute logits.

Used on real gloo ranks (``mindspeed.testing.distributed.run_distributed``) to prove that a
conversion is right the only way that matters: the megatron-core ``GPTModel`` built for the
target layout (through ``mindspeed.megatron``'s spec) loads this rank's file strictly and
computes the same logits as the transformers model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing.trust import load_torch_file
from mindspeed.megatron.config import expert_tensor_parallel_size
from mindspeed.megatron.trusted_load import check_dist_checkpoint, trusted_dist_loads
from mindspeed_llm.bridges import ModelShape, ParallelLayout, RankKey
from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
from mindspeed_llm.checkpoint.megatron_dist import is_dist_checkpoint
from mindspeed_llm.checkpoint.megatron_legacy import (
    TRACKER,
    LegacyCheckpointReader,
    iteration_dir,
    layout_from_args,
    model_keys,
    rank_dir,
)

#: Every registry kernel of the spec at its pure-PyTorch reference.
REFERENCE_IMPLS = {"rms_norm": "reference", "layer_norm": "reference", "attention": "reference", "swiglu": "reference"}


def init_layout(layout: ParallelLayout, shape: ModelShape, seed: int = 1234) -> None:
    """Initialise megatron's parallel state (and RNG tracker) for ``layout`` on the current world."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.num_chunks(shape) if layout.vpp_layers else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=expert_tensor_parallel_size(shape, None),
        # Forward passes need no gloo side groups (megatron creates one per group otherwise: seconds).
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(seed)


def checkpoint_model(checkpoint: str | Path) -> tuple[ModelShape, ParallelLayout, Any]:
    """The model shape, the recorded layout and the args of a converted checkpoint (either format)."""
    checkpoint = Path(checkpoint)
    if is_dist_checkpoint(checkpoint):
        from megatron.core import dist_checkpointing

        text = (checkpoint / TRACKER).read_text().strip()
        directory = checkpoint / iteration_dir(int(text))
        check_dist_checkpoint(directory)
        with trusted_dist_loads():
            args = dist_checkpointing.load_common_state_dict(str(directory))["args"]
    else:
        args = LegacyCheckpointReader(checkpoint).args
    return ModelShape.from_args(args), layout_from_args(args), args


def load_rank_chunks(checkpoint: str | Path, impls: dict[str, str] | None = None) -> list[Any]:
    """Build this rank's model chunks for a converted checkpoint and load it strictly.

    Megatron's parallel state must already be initialised (:func:`init_layout`); a per-rank
    checkpoint must have been written for that layout, a dist checkpoint loads at any layout
    (through megatron's own modules: ``sharded_state_dict`` walks every module).
    """
    from megatron.core import parallel_state as ps

    checkpoint = Path(checkpoint)
    shape, recorded, args = checkpoint_model(checkpoint)
    layout = ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        vpp_layers=recorded.vpp_layers,
    )
    if is_dist_checkpoint(checkpoint):
        from megatron.core import dist_checkpointing

        chunks = build_gpt_chunks(shape, layout, vocab_size=args.padded_vocab_size, megatron_modules=True)
        keys = model_keys(len(chunks))
        text = (checkpoint / TRACKER).read_text().strip()
        with trusted_dist_loads():
            state = dist_checkpointing.load(
                {k: c.sharded_state_dict() for k, c in zip(keys, chunks)}, str(checkpoint / iteration_dir(int(text)))
            )
    else:
        chunks = build_gpt_chunks(shape, layout, impls or REFERENCE_IMPLS)
        keys = model_keys(len(chunks))
        rank = RankKey(
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
        )
        state = load_torch_file(
            checkpoint / iteration_dir(1) / rank_dir(rank, layout) / "model_optim_rng.pt", map_location="cpu"
        )
    for chunk, key in zip(chunks, keys):
        chunk.load_state_dict(state[key], strict=True)
    return chunks


def megatron_logits(chunks: list[Any], tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits of ``tokens`` through megatron's own pipeline schedule (one sequence per microbatch).

    Returns:
        ``[batch, seq, vocab]`` logits (gathered over tensor parallelism, padding rows included)
        on the last pipeline stage; ``None`` on the others.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0)
    micro = [{"tokens": tokens[i : i + 1], "position_ids": positions} for i in range(batch)]

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        item = next(data_iterator)
        output = model(item["tokens"], item["position_ids"], None)
        return output, lambda out: (out.sum() * 0.0, {"logits": out.detach().clone()})

    with torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in chunks],
            model=chunks,
            num_microbatches=batch,
            seq_length=seq,
            micro_batch_size=1,
            forward_only=True,
        )
    if not stored:
        return None
    local = torch.cat([item["logits"] for item in stored])
    group = ps.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def destroy_layout() -> None:
    """Undo :func:`init_layout`."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
