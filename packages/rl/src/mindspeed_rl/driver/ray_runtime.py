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

A local instance dies with its driver, even one killed by ``kill -9``: Ray's node processes go
with the driver, but the agents the raylet starts (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) were seen alive more than 60 s later. :func:`init_ray` therefore marks
the instance's processes with an environment variable they all inherit and starts a watchdog
(a bare Python process reading a pipe from the driver) that kills every marked process once the
pipe closes, i.e. when the driver is gone, however it ended (Linux; ``/proc``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: Environment defaults applied by :func:`init_ray` (before Ray is imported).
RAY_ENV_DEFAULTS = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LOCAL_RAY_ENV_DEFAULTS = {"RAY_AUTH_MODE": "disabled"}
#: Environment variable every process of a local instance inherits (its value names the instance).
OWNER_ENV = "MINDSPEED_RAY_OWNER"

# Runs without imports beyond os/signal/sys/time: blocks on the driver's pipe, then kills the marked
# processes, pass after pass until none has been seen for 3 s (a dying raylet may still be starting
# its agents while the first passes run).
_WATCHDOG = r"""
import os, signal, sys, time
marker = sys.argv[1].encode() + b"\0"
sys.stdin.buffer.read()
me = str(os.getpid())
quiet_since = time.monotonic()
while time.monotonic() - quiet_since < 3.0:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and name != me:
            try:
                with open("/proc/" + name + "/environ", "rb") as f:
                    if marker in f.read():
                        found.append(int(name))
            except OSError:
                pass
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if found:
        quiet_since = time.monotonic()
    time.sleep(0.1)
"""


_reaper: subprocess.Popen | None = None


def start_reaper() -> subprocess.Popen | None:
    """Mark the processes started from now on and start the watchdog that kills them when this
    process exits (see the module docstring); None where ``/proc`` is absent."""
    global _reaper
    if not os.path.isdir("/proc") or _reaper is not None:  # one watchdog per process; a child driver gets its own
        return _reaper
    os.environ[OWNER_ENV] = f"{os.getpid()}-{uuid.uuid4().hex}"
    marker = f"{OWNER_ENV}={os.environ[OWNER_ENV]}"
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    # Held for the life of this process: closing the pipe is what tells the watchdog to act.
    _reaper = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, marker], stdin=subprocess.PIPE, env=env, start_new_session=True
    )
    return _reaper


def init_ray(address: str | None = None, num_cpus: int | None = None, **options: Any) -> Any:
    """``ray.init`` with the suite's defaults; returns the ``ray`` module.

    Args:
        address: an existing cluster (``ray://host:10001``, ``host:6379`` or ``auto``); None
            joins the cluster ``RAY_ADDRESS`` names, or starts a local instance without it.
        num_cpus: CPUs of a local instance (default: all).
        options: more ``ray.init`` keywords (``include_dashboard`` and ``log_to_driver``
            default to False).

    Returns:
        The imported ``ray`` module, initialised (an instance already running is kept).
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    defaults = {**RAY_ENV_DEFAULTS, **({} if address else LOCAL_RAY_ENV_DEFAULTS)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    imported_before = "ray" in sys.modules
    import ray

    if imported_before and os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0":
        # Ray read the variable when it was imported (before this call): its constant still says
        # "uv run every worker". ray.init reads the constant at call time, so it is set here too.
        constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
        if constants is not None and getattr(constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False):
            constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False

    if ray.is_initialized():
        return ray
    options.setdefault("include_dashboard", False)
    options.setdefault("log_to_driver", False)
    if address is None:
        start_reaper()
    ray.init(address=address, num_cpus=None if address else num_cpus, **options)
    logger.info("ray: %s (%s)", address or "local instance", ray.cluster_resources())
    return ray
