"""The replay buffer (TransferDock), its Ray actor, and sequence-length balancing."""

from __future__ import annotations

from mindspeed_rl.buffer.balance import balanced_partitions, micro_batches_by_tokens
from mindspeed_rl.buffer.remote import BufferClient, create_buffer_actor
from mindspeed_rl.buffer.replay import VERSION, ReplayBuffer, StalenessError

__all__ = [
    "VERSION",
    "BufferClient",
    "ReplayBuffer",
    "StalenessError",
    "balanced_partitions",
    "create_buffer_actor",
    "micro_batches_by_tokens",
]
