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

from mindspeed_llm.bridges import ModelShape, ParallelLayout
from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
from mindspeed_llm.checkpoint.megatron_legacy import LegacyCheckpointReader, model_keys, rank_dir

#: Every registry kernel of the spec at its pure-PyTorch reference.
REFERENCE_IMPLS = {"rms_norm": "reference", "layer_norm": "reference", "attention": "reference", "swiglu": "reference"}


def init_layout(layout: ParallelLayout, shape: ModelShape, seed: int = 1234) -> None:
    """Initialise megatron's parallel state (and RNG tracker) for ``layout`` on the current world."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.num_chunks(shape) if layout.vpp_layers else None,
        expert_model_parallel_size=layout.ep,
        # Forward passes need no gloo side groups (megatron creates one per group otherwise: seconds).
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(seed)


def load_rank_chunks(checkpoint: str | Path, impls: dict[str, str] | None = None) -> tuple[list[Any], ModelShape, ParallelLayout]:
    """Build this rank's model chunks for a converted checkpoint and load its file strictly.

    The checkpoint's args give the model and the layout; megatron's parallel state must already
    be initialised for that layout (:func:`init_layout`).

    Returns:
        The chunks, the model shape and the layout.
    """
    from megatron.core import parallel_state as ps

    reader = LegacyCheckpointReader(checkpoint)
    shape, layout = ModelShape.from_args(reader.args), reader.layout
    chunks = build_gpt_chunks(shape, layout, impls or REFERENCE_IMPLS)
    rank = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())
    from mindspeed_llm.bridges.layout import RankKey

    path = reader.iter_path / rank_dir(RankKey(*rank), layout) / "model_optim_rng.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    for chunk, key in zip(chunks, model_keys(len(chunks))):
        chunk.load_state_dict(state[key], strict=True)
    return chunks, shape, layout


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
    micro = [{"tokens": tokens[i:i + 1], "position_ids": positions} for i in range(batch)]

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        item = next(data_iterator)
        output = model(item["tokens"], item["position_ids"], None)
        return output, lambda out: (out.sum() * 0.0, {"logits": out.detach().clone()})

    with torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(micro) for _ in chunks], model=chunks,
            num_microbatches=batch, seq_length=seq, micro_batch_size=1, forward_only=True,
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
