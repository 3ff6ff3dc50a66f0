"""Starting Ray for the RL suite: a local instance by default, or an existing cluster.

Three Ray defaults hurt on a laptop or a CI runner, so :func:`init_ray` changes them (each only
where the environment does not set it already):

- ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``: under ``uv run`` Ray otherwise packages the working
  directory and starts every worker through ``uv run`` in a copy of it, which builds a fresh
  virtual environment per worker: measured here, the first actor took 205 s to start instead of
  2.3 s. Ray reads this variable when it is imported, so it is set before ``import ray``.
- ``RAY_USAGE_STATS_ENABLED=0``: no usage report (no network).
- ``RAY_AUTH_MODE=disabled`` for a local instance: Ray 2.60 otherwise writes a token file under
  the home directory and warns on every start.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: Environment defaults applied by :func:`init_ray` (before Ray is imported).
RAY_ENV_DEFAULTS = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LOCAL_RAY_ENV_DEFAULTS = {"RAY_AUTH_MODE": "disabled"}


def init_ray(address: str | None = None, num_cpus: int | None = None, **options: Any) -> Any:
    """``ray.init`` with the suite's defaults; returns the ``ray`` module.

    Args:
        address: an existing cluster (``ray://host:10001`` or ``host:6379``); None starts a
            local instance.
        num_cpus: CPUs of a local instance (default: all).
        options: more ``ray.init`` keywords (``include_dashboard`` and ``log_to_driver``
            default to False).

    Returns:
        The imported ``ray`` module, initialised (an instance already running is kept).
    """
    defaults = {**RAY_ENV_DEFAULTS, **({} if address else LOCAL_RAY_ENV_DEFAULTS)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "ray" in sys.modules and os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0":
        logger.warning("ray was imported before init_ray: if this process runs under `uv run`, set "
                       "RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 before importing ray, or workers start very slowly")
    import ray

    if ray.is_initialized():
        return ray
    options.setdefault("include_dashboard", False)
    options.setdefault("log_to_driver", False)
    ray.init(address=address, num_cpus=None if address else num_cpus, **options)
    logger.info("ray: %s (%s)", address or "local instance", ray.cluster_resources())
    return ray
