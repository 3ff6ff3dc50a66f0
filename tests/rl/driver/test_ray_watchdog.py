"""The Ray watchdog (``ray_runtime.start_reaper``) without Ray: a driver marks its children and
dies by ``kill -9``; the marked children die with it, an unmarked process lives on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the watchdog reads /proc")

_DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys
    from mindspeed_rl.driver import ray_runtime

    first = ray_runtime.start_reaper()
    assert ray_runtime.start_reaper() is first, "a second call starts a second watchdog"
    marked = subprocess.Popen(["sleep", "120"])
    env = {k: v for k, v in os.environ.items() if k != ray_runtime.OWNER_ENV}
    unmarked = subprocess.Popen(["sleep", "120"], env=env, start_new_session=True)
    print(first.pid, marked.pid, unmarked.pid, flush=True)
    sys.stdin.read()
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_watchdog_kills_marked_processes_after_driver_kill9() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_RAY_OWNER"}
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    watchdog, marked, unmarked = (int(x) for x in driver.stdout.readline().split())
    try:
        assert _alive(watchdog) and _alive(marked) and _alive(unmarked)
        with open(f"/proc/{watchdog}/environ", "rb") as f:
            assert b"MINDSPEED_RAY_OWNER=" not in f.read(), "the watchdog must not mark (and kill) itself"
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 20
        while (_alive(marked) or _alive(watchdog)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(marked), "a marked child outlived its driver"
        assert not _alive(watchdog), "the watchdog did not exit after its pass"
        assert _alive(unmarked), "an unmarked process was killed"
    finally:
        for pid in (marked, unmarked, watchdog):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
