"""Context parallelism: attention over a sequence sharded across ranks.

Five algorithms under MindSpeed's names (``context_parallel_algo``):

- ``ulysses_cp_algo``: all-to-all from sequence shards to head shards and back;
- ``megatron_cp_algo``: ring attention over zig-zag shards, online-softmax merge;
- ``hybrid_cp_algo``: Ulysses inside each ring step's shard (``ulysses_degree_in_cp``);
- ``kvallgather_cp_algo``: zig-zag queries against all-gathered keys and values;
- ``adaptive_cp_algo``: ring, KV all-gather or no communication, chosen from the mask.

``megatron_cp_algo`` with ``cp_window_size > 1`` is the double ring (inner and outer rings).

All are plain torch.distributed code with process groups passed as values, usable from a
megatron-core attention module and from plain PyTorch modules. See docs/core/context-parallel.md.
"""

from mindspeed.parallel.context_parallel.adaptive import AdaptiveChoice, choose_cp_algo
from mindspeed.parallel.context_parallel.api import ContextParallelAttention, context_parallel_attention
from mindspeed.parallel.context_parallel.config import ContextParallelConfig
from mindspeed.parallel.context_parallel.groups import ContextParallelGroups, build_context_parallel_groups
from mindspeed.parallel.context_parallel.layout import (
    ADAPTIVE,
    ALGOS,
    HYBRID,
    KVALLGATHER,
    RING,
    ULYSSES,
    gather_from_context_parallel,
    positions_for_context_parallel,
    shard_lengths,
    shard_ranges,
    split_for_context_parallel,
)

__all__ = [
    "ADAPTIVE",
    "ALGOS",
    "AdaptiveChoice",
    "HYBRID",
    "KVALLGATHER",
    "RING",
    "ULYSSES",
    "ContextParallelAttention",
    "ContextParallelConfig",
    "ContextParallelGroups",
    "build_context_parallel_groups",
    "choose_cp_algo",
    "context_parallel_attention",
    "gather_from_context_parallel",
    "positions_for_context_parallel",
    "shard_lengths",
    "shard_ranges",
    "split_for_context_parallel",
]
