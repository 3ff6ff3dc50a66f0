"""Packed attention and Ulysses sequence parallelism over the language model's sequence.

The ranks of a sequence-parallel group get the same packed microbatch. Each runs the model's
own forward up to the language model (embeddings, vision tower, the merge of image features
into the text embeddings, the multimodal positions) on the whole row. A forward pre-hook on the
language model then:

1. hands the attention the row's sample boundaries (a
   :class:`~mindspeed_mm.models.attention.PackedAttention`, passed as a keyword that transformers
   forwards to every attention call; the registered ``mindspeed`` attention reads it);
2. with ``U`` ranks, keeps this rank's contiguous ``1/U`` of every per-token input: the
   embeddings, every row of ``position_ids`` (M-RoPE's three axes and the text row alike, so
   each token keeps its own rotary position) and Qwen3-VL's DeepStack inputs (the visual-token
   mask and the rows of the visual embeddings that fall in the shard).

Every layer then works on the shard; the attention trades the sequence shard for a head shard
with the core's Ulysses all-to-all and back. The head returns this shard's logits: the task
takes the same slice of the targets and reduces the loss over the group
(:func:`mindspeed_mm.trainer.loss.reduce_loss` with ``sp``). The gradient of the slice sends
each rank's part back to the whole row, so the vision tower and the embeddings get, summed
over the group by FSDP2, exactly the gradient of the unsplit model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mindspeed.parallel.context_parallel.layout import split_sizes
from mindspeed_mm.models.attention import CONTEXT_KWARG, PackedAttention
from mindspeed_mm.models.family import VLMFamily

#: Language-model keywords whose last dimension is the sequence (``position_ids``: ``[1, L]`` or ``[4, 1, L]``).
_LAST_DIM = ("position_ids",)
#: Keywords whose dimension 1 is the sequence (``[batch, L, ...]``).
_DIM_1 = ("inputs_embeds", "visual_pos_masks")


def local_range(seq_len: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous shard of a ``seq_len`` row over ``size`` ranks (Ulysses' layout).

    Raises:
        ValueError: a row shorter than the group (some rank would hold nothing).
    """
    if seq_len < size:
        raise ValueError(
            f"a packed row of {seq_len} tokens cannot be split over parallel.ulysses_parallel_size={size} "
            "ranks; raise train.micro_batch_size or lower parallel.ulysses_parallel_size"
        )
    sizes = split_sizes(seq_len, size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


class SequenceParallel:
    """The language model's pre-hook; call :meth:`begin` before each microbatch's forward.

    Args:
        model: the model (sharded or not).
        family: its family (the language model's module name).
        group: the Ulysses group (None: one rank, the boundaries only).
    """

    def __init__(self, model: torch.nn.Module, family: VLMFamily, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.context: PackedAttention | None = None
        self.range = (0, 0)
        language = model.get_submodule(family.language_module)
        self.handle = language.register_forward_pre_hook(self._hook, with_kwargs=True)

    def begin(self, sample_index: torch.Tensor) -> tuple[int, int]:
        """Set up the next forward of a packed row whose tokens belong to samples ``sample_index`` ([L], ascending).

        Returns:
            This rank's ``[start, end)`` of the row (the whole row on one rank).
        """
        lengths = torch.bincount(sample_index)
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        cu_seqlens[1:] = lengths.cumsum(0)
        seq_len = int(sample_index.numel())
        self.context = PackedAttention(cu_seqlens, seq_len, self.group if self.size > 1 else None)
        self.range = local_range(seq_len, self.rank, self.size)
        return self.range

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if self.context is None:
            raise ValueError("SequenceParallel.begin was not called before the forward")
        kwargs = {**kwargs, CONTEXT_KWARG: self.context}
        if self.size == 1:
            return args, kwargs
        start, end = self.range
        if kwargs.get("inputs_embeds") is None:
            raise ValueError("sequence parallelism needs the language model called with inputs_embeds")
        for name in _LAST_DIM:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][..., start:end]
        masks = kwargs.get("visual_pos_masks")
        embeds = kwargs.get("deepstack_visual_embeds")
        if masks is not None and embeds is not None:  # the visual rows of this shard (in row order)
            before, inside = int(masks[:, :start].sum()), int(masks[:, start:end].sum())
            kwargs["deepstack_visual_embeds"] = [e[before : before + inside] for e in embeds]
        for name in _DIM_1:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:, start:end]
        return args, kwargs

    def remove(self) -> None:
        """Remove the hook."""
        self.handle.remove()
