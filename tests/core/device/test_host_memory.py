"""retain_freed_host_memory: freed host blocks are reused without page faults; after the block, blocks above 32 MiB
are mapped afresh again (as glibc does) and smaller ones still reused (as glibc's on-the-fly thresholds would have it:
the 128 KiB defaults with the raising off left every later block above 128 KiB faulting in)."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from mindspeed.device import retain_freed_host_memory
from mindspeed.device.host_memory import _mallopt

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or _mallopt() is None, reason="glibc's mallopt only")


def _faults_of_churn(rounds: int = 20, numel: int = 2**21) -> int:
    """Minor page faults of allocating, touching and freeing an 8 MiB tensor ``rounds`` times."""
    torch.ones(numel).sum()  # the first touch of the size, outside the count
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.ones(numel).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _faults_of_fresh_blocks() -> int:
    """Faults of 64 MiB blocks, larger than any free chunk the churn left in the heap.

    With the exit thresholds (32 MiB), each is mapped afresh and unmapped when freed (16,384 pages a
    round); were the retaining thresholds still on, the rounds after the first would reuse the heap and
    fault next to nothing. (8 MiB blocks would not tell: the chunks the churn left free serve them.)
    """
    return _faults_of_churn(rounds=5, numel=2**24)


@glibc
def test_freed_blocks_are_reused_without_page_faults() -> None:
    with retain_freed_host_memory() as on:
        assert on
        _faults_of_churn()  # the heap grows to its working size
        retained = _faults_of_churn()
    returned = _faults_of_fresh_blocks()  # above the exit threshold: mapped afresh, as glibc does
    # Below it: still reused. 16 MiB blocks, larger than the chunks the churn left free (the 128 KiB defaults with
    # glibc's raising off mapped each afresh: 4,096 faults a round).
    after = _faults_of_churn(rounds=5, numel=2**22)
    assert retained < 200, retained  # a fresh 8 MiB block faults 2,048 pages
    assert returned > 4 * 10_000, returned
    assert after < 2_000, after


@glibc
def test_disabled_changes_nothing() -> None:
    with retain_freed_host_memory(enabled=False) as on:
        assert not on
