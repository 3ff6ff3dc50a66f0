"""Run a function on N real ranks (spawned processes, gloo on the CPU) from a test.

``run_distributed(fn, world_size)`` spawns ``world_size`` processes, initialises
torch.distributed in each with the accelerator's backend, calls ``fn(rank, world_size, *args)``
and returns the ranks' return values in rank order. A rank that raises fails the call with
its traceback; a rank that hangs (a collective nobody joins) fails it after ``timeout``
seconds instead of hanging CI. Processes are always reaped.

On a 2-core machine each rank costs seconds of imports: check many things inside one group.
Ranks start from a fork server that has imported torch, megatron-core and transformers once
(:data:`PRELOAD`), so a rank pays only for what its test imports beyond those; each rank gets the
caller's current environment, working directory and ``sys.path``, as a spawned one would.
``MINDSPEED_TEST_START_METHOD=spawn`` starts every rank from scratch instead.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: Third-party modules every rank imports, loaded once into the fork server the ranks start from.
PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers")
#: Set to ``spawn`` to start every rank as a fresh interpreter.
START_METHOD_ENV = "MINDSPEED_TEST_START_METHOD"


def _context() -> Any:
    """The multiprocessing context ranks start from: a preloaded fork server where the platform has one."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method != "forkserver" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Only takes effect when the server starts (the first group of the process); later calls are no-ops.
    ctx.set_forkserver_preload([name for name in PRELOAD if importlib.util.find_spec(name.split(".")[0])])
    return ctx


def start_fork_server() -> None:
    """Start the ranks' fork server now, with this process's environment (it preloads in the background).

    Call it early (a test session's start): the server's own environment is the one it starts
    with, and a process scanning ``/proc`` for the markers of a later run must not find it.
    """
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def find_free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: tuple,
    env: dict[str, str],
    results: mp.Queue,
    timeout: float,
    caller: tuple[dict[str, str], str, list[str]],
) -> None:
    # A forked rank inherits the fork server's state: take the caller's as a spawned rank would.
    environ, cwd, path = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    try:
        # Loaded already in a rank forked from the server; the thread count is set explicitly below.
        import torch
        import torch.distributed as dist

        from mindspeed.device import get_accelerator

        # Ranks share the cores: one thread each keeps 2 ranks on 2 cores from thrashing.
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        accelerator = get_accelerator()
        if accelerator.name != "cpu":
            accelerator.set_device(rank % max(accelerator.device_count(), 1))
        dist.init_process_group(
            backend=backend or accelerator.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Tensors travel as shared-memory files kept by torch's manager, not as file descriptors
        # that die with the rank (it exits right after this).
        torch.multiprocessing.set_sharing_strategy("file_system")
        results.put((rank, True, value))
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None


class DistributedTestError(RuntimeError):
    """A rank raised, died or hung."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks.
        *args: picklable arguments passed to every rank.
        timeout: seconds before the whole group is killed and the call fails.
        backend: torch.distributed backend (default: the accelerator's, gloo on the CPU).
        env: extra environment variables for the ranks (``OMP_NUM_THREADS`` defaults to 1).

    Returns:
        The return values of ``fn``, in rank order (they must be picklable).

    Raises:
        DistributedTestError: with the failing ranks' tracebacks, or naming the ranks that hung.
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    rank_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, backend, args, rank_env, results, timeout, caller),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                hung = sorted(set(range(world_size)) - set(outcomes))
                raise DistributedTestError(
                    f"ranks {hung} did not finish within {timeout:.0f} s (a collective that not every "
                    f"rank joins?); finished: {sorted(outcomes)}" + _failures(outcomes)
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (ok, value)
                if not ok:  # one failure: the others would wait on it forever
                    break
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in outcomes
                ]
                if dead:
                    # Give its queued message a moment to arrive before declaring a silent death.
                    time.sleep(0.5)
                    while not results.empty():
                        rank, ok, value = results.get_nowait()
                        outcomes[rank] = (ok, value)
                    missing = [r for r in dead if r not in outcomes]
                    if missing:
                        raise DistributedTestError(
                            f"ranks {missing} died with exit codes {[procs[r].exitcode for r in missing]}"
                            + _failures(outcomes)
                        ) from None
                    break
        failures = _failures(outcomes)
        if failures:
            raise DistributedTestError("a rank failed" + failures)
        return [outcomes[rank][1] for rank in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()


def _failures(outcomes: dict[int, tuple[bool, Any]]) -> str:
    return "".join(f"\n--- rank {rank} ---\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok)
