"""``init_ray`` joins the cluster ``RAY_ADDRESS`` names when the recipe gives no ``ray.address``."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.mark.parametrize(
    ("recipe", "env", "joined", "cpus", "reaper"),
    [
        (None, "10.0.0.1:6379", "10.0.0.1:6379", None, False),  # RAY_ADDRESS alone: join, no CPU count
        ("auto", "10.0.0.1:6379", "auto", None, False),  # the recipe's key wins
        (None, None, None, 3, True),  # neither: a local instance with the driver's CPU count and its reaper
    ],
)
def test_ray_address_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
    recipe: str | None,
    env: str | None,
    joined: str | None,
    cpus: int | None,
    reaper: bool,
) -> None:
    import ray

    from mindspeed_rl.driver import ray_runtime

    calls: dict[str, Any] = {}
    environ = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    if env is not None:
        environ["RAY_ADDRESS"] = env
    monkeypatch.setattr(os, "environ", environ)  # what init_ray sets stays in this test
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.update(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    monkeypatch.setattr(ray_runtime, "start_reaper", lambda: calls.update(reaper=True))
    ray_runtime.init_ray(recipe, num_cpus=3)
    assert calls["address"] == joined and calls["num_cpus"] == cpus
    assert calls.get("reaper", False) is reaper
