"""The fp32 master rebuilt exactly from its round-to-nearest-even bf16 copy and a 16-bit remainder."""

from __future__ import annotations

import torch

from mindspeed.memory.fp32_reuse import merge_fp32, split_fp32


def _bits(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_split_and_merge_round_trip_every_kind_of_value() -> None:
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    random = random.view(torch.float32)
    random = random[torch.isfinite(random)]
    # Ties (low half exactly 0x8000) with even and odd upper halves, both signs, and the edges:
    # zeros, subnormals, the largest finite value (rounds to inf), infinities.
    special = _bits(
        0x3F808000,
        0x3F818000,
        0xBF808000 - 2**32,
        0xBF818000 - 2**32,
        0,
        -(2**31),
        1,
        0x8000,
        0x7F7FFFFF,
        0x7F7F8000,
        0x7F800000,
        0xFF800000 - 2**32,
        0x3F807FFF,
        0x3F808001,
    )
    for master in (random, special, torch.randn(4, 33, generator=gen)):
        bf16 = master.to(torch.bfloat16)  # megatron's cast: round to nearest even
        remainder, ties = split_fp32(master, bf16)
        assert remainder.dtype == torch.int16 and remainder.shape == master.shape
        rebuilt = merge_fp32(bf16, remainder, ties, torch.empty_like(master))
        assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))
    _, ties = split_fp32(special, special.to(torch.bfloat16))
    assert ties.tolist() == [0, 2, 7]  # even upper half, low 0x8000: rounded down, remainder +32768
