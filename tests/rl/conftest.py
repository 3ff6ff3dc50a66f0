"""Shared RL test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_policy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the demo policy (``actor.model: demo``), built once per test session.

    The build is the real one (a warm-start fit of about a minute on one core), so tests that
    need the trained-enough demo policy share it instead of each paying for it.
    """
    from mindspeed_rl.demo.model import resolve_model

    cache = tmp_path_factory.getbasetemp() / "rl-demo-model"
    resolve_model("demo", cache)
    return cache
