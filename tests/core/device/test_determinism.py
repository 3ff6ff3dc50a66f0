"""``deterministic_mode``: torch's deterministic algorithms and the accelerator's environment, put back on exit."""

from __future__ import annotations

import os

import torch

from mindspeed.device import deterministic_env, deterministic_mode


def test_deterministic_mode_switches_on_and_restores() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    keys = set(deterministic_env(7))
    before = {key: os.environ.get(key) for key in keys}
    with deterministic_mode(True, seed=7) as added:
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["PYTHONHASHSEED"] == (before["PYTHONHASHSEED"] or "7")
        assert set(added) <= keys
    assert not torch.are_deterministic_algorithms_enabled()
    assert {key: os.environ.get(key) for key in keys} == before
    with deterministic_mode(False) as added:
        assert added == {} and not torch.are_deterministic_algorithms_enabled()
