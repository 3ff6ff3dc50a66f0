"""Accelerator resolution: ``MINDSPEED_ACCELERATOR`` forces a family, else the best available one wins, once."""

from __future__ import annotations

import pytest

from mindspeed.device import ACCELERATOR_ENV, ACCELERATORS, available_accelerators, get_accelerator, set_accelerator
from mindspeed.device import accelerator as accelerator_module


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """Nothing resolved yet, and whatever this process had resolved is back afterwards."""
    monkeypatch.setattr(accelerator_module, "_current", None)
    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)
    return monkeypatch


def _available(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Pretend exactly ``names`` (and the CPU) are usable here."""
    for name, cls in ACCELERATORS.items():
        monkeypatch.setattr(cls, "is_available", classmethod(lambda c, on=name in names or name == "cpu": on))


def test_the_cpu_is_always_there_and_the_host_default() -> None:
    assert available_accelerators()[-1] == "cpu"
    assert set(ACCELERATORS.keys()) >= {"npu", "cuda", "cpu"}


def test_auto_detection_prefers_npu_then_cuda_then_cpu(fresh: pytest.MonkeyPatch) -> None:
    for available, expected in (((), "cpu"), (("cuda",), "cuda"), (("npu",), "npu"), (("cuda", "npu"), "npu")):
        _available(fresh, *available)
        assert set_accelerator(None).name == expected, available
        assert available_accelerators() == [n for n in ("npu", "cuda", "cpu") if n in available or n == "cpu"]


def test_the_environment_variable_forces_a_family(fresh: pytest.MonkeyPatch) -> None:
    _available(fresh, "cuda", "npu")
    fresh.setenv(ACCELERATOR_ENV, "cpu")
    acc = get_accelerator()
    assert acc.name == "cpu" and acc.dist_backend == "gloo"
    fresh.setenv(ACCELERATOR_ENV, "cuda")
    assert get_accelerator() is acc, "resolved once: a later change of the variable does not switch families"
    fresh.setattr(accelerator_module, "_current", None)
    assert get_accelerator().name == "cuda"


def test_a_forced_family_that_is_missing_or_unknown_is_a_clear_error(fresh: pytest.MonkeyPatch) -> None:
    _available(fresh)
    fresh.setenv(ACCELERATOR_ENV, "npu")
    with pytest.raises(
        ValueError,
        match=rf"accelerator 'npu' was requested \(argument or {ACCELERATOR_ENV}\) but is "
        r"not available in this process; available: cpu",
    ):
        get_accelerator()
    fresh.setenv(ACCELERATOR_ENV, "tpu")
    with pytest.raises(ValueError, match="tpu.*cpu.*cuda.*npu|tpu.*npu.*cuda.*cpu"):
        get_accelerator()
    with pytest.raises(ValueError, match="'npu' was requested"):
        set_accelerator("npu")
