"""Starting the ranks of a run: under torchrun, in this process, or as spawned local processes.

``launch(target, args, nproc_per_node)`` calls ``target(*args)`` on every rank with
torch.distributed initialised (the accelerator's backend: gloo on the CPU) and returns rank 0's
return value:

- under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank; torchrun
  owns the other ranks, the nodes and the restarts;
- with one process, the run happens here;
- with several nodes (:class:`~mindspeed.nodes.Nodes`: torchrun's ``--nnodes``, ``--node-rank``,
  ``--master-addr``, ``--master-port``) one launcher runs on every node and its ranks are
  ``node_rank * nproc_per_node + local_rank`` of ``nnodes * nproc_per_node``, as torchrun numbers
  them; they meet at the master address, where global rank 0 serves the c10d store;
- otherwise ``nproc_per_node`` processes are spawned. The first rank that fails stops the
  others (SIGTERM, then SIGKILL after a grace period); SIGTERM sent to the launcher reaches the
  ranks, its first SIGINT reaches them as :data:`~mindspeed.checkpointing.LAUNCHER_INTERRUPT`
  (ranks ignore SIGINT itself, which a terminal sends to every process of the group) and a
  second one kills them at once; ranks die with their launcher (``PR_SET_PDEATHSIG`` on Linux,
  a watchdog elsewhere), so ``kill -9`` of the launcher leaves no orphans.

With ``nodes.max_restarts`` N (torchrun's ``--max-restarts``; one node) a failed rank (an error, or
killed) makes the launcher stop the others and start all of them again, up to N times, with
torchrun's ``TORCHELASTIC_RESTART_COUNT``; they resume from the newest complete checkpoint as any
new run does. Clean exits, preemption (the launcher's SIGTERM or Ctrl-C: 143 / 130) and user errors
(``ValueError``, a full disk: the same command would fail the same way) are not restarted. Each
restart is one warning line; after N the run fails with one line naming the last failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from mindspeed.checkpointing import (
    EXIT_SIGINT,
    LAUNCHER_INTERRUPT,
    DiskFullError,
    die_with_parent,
    interrupts_come_from_launcher,
)
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger, setup_logging
from mindspeed.nodes import Nodes, RankFailure, peer_lost
from mindspeed.parallel.gloo import one_gloo_device

logger = get_logger(__name__)

#: Seconds ranks get to exit after SIGTERM before they are killed.
GRACE_S = 10.0


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or compatible) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(backend: str, timeout: timedelta) -> None:
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # A group torchrun restarted: its agent's store outlives the ranks (its c10d rendezvous shares it), and the
    # addresses the last attempt's ranks left there would send gloo to dead peers (pytorch#135712). One prefix
    # per attempt keeps the attempts apart, as torch's own rendezvous did before it shared the store.
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"mindspeed/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world,
        timeout=timeout,
    )


def _run_rank(target: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    import torch.distributed as dist

    accelerator = get_accelerator()
    if accelerator.name != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")) % max(accelerator.device_count(), 1))
    # One rank: its gloo groups (megatron makes ~20) share one transport device, so one idle loop thread
    # wakes every 10 ms instead of one per group (mindspeed.parallel.gloo).
    with one_gloo_device(int(os.environ.get("WORLD_SIZE", "1")), accelerator.dist_backend):
        _init_process_group(accelerator.dist_backend, timedelta(seconds=timeout_s))
        try:
            return target(*args)
        except RuntimeError as err:  # one line for a lost peer, not a traceback from deep in a collective
            lost = peer_lost(err, dist.get_rank()) if dist.get_world_size() > 1 else None
            if lost is None:
                raise
            raise lost from None
        finally:
            dist.destroy_process_group()


def _spawned_main(
    target: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    parent: int,
    threads: int,
    timeout_s: float,
    log_level: str | None,
    first: int,
    results: mp.Queue,
) -> None:
    die_with_parent(parent)
    interrupts_come_from_launcher()
    os.environ.update(env)
    rank = int(env["RANK"])
    if log_level is not None:  # a spawned interpreter starts without the launcher's logging setup
        setup_logging(log_level)
    try:
        import torch

        # Ranks of one host share its cores: an even share each keeps them from thrashing.
        torch.set_num_threads(threads)
        value = _run_rank(target, args, timeout_s)
        results.put((rank, "ok", value if rank == first else None))
    except ValueError as err:  # a user error: one line, the launcher re-raises it
        results.put((rank, "value_error", str(err)))
        sys.exit(2)
    except DiskFullError as err:  # a save that ran out of space: one line, re-raised too
        results.put((rank, "disk_full", str(err)))
        sys.exit(1)
    except BaseException:  # everything else with its traceback
        results.put((rank, "error", traceback.format_exc()))
        sys.exit(1)


def launch(
    target: Callable[..., Any],
    args: tuple = (),
    nproc_per_node: int = 1,
    timeout_s: float = 1800.0,
    log_level: str | None = None,
    nodes: Nodes | None = None,
) -> Any:
    """Run ``target(*args)`` on every rank and return the result of this node's first rank (global rank 0's on
    node 0; under torchrun, this rank's own).

    Args:
        target: a module-level (picklable) function; torch.distributed is initialised around it.
        args: picklable arguments.
        nproc_per_node: processes to spawn here when not under torchrun.
        timeout_s: collective timeout of the process group.
        log_level: set up ``mindspeed.log`` at this level in spawned ranks (``None``: leave it).
        nodes: this launcher's node among several (``None``: one node).

    Raises:
        ValueError: a rank raised one (a user error), re-raised with its message.
        DiskFullError: a rank's save ran out of space, re-raised with its message.
        RankFailure: a rank failed otherwise, or was killed.
    """
    nodes = nodes or Nodes()
    if under_torchrun():
        if nodes.nnodes > 1:
            logger.warning(
                "--nnodes %d is ignored under torchrun (WORLD_SIZE=%s)", nodes.nnodes, os.environ["WORLD_SIZE"]
            )
        if nproc_per_node > 1 and str(nproc_per_node) != os.environ.get("LOCAL_WORLD_SIZE", str(nproc_per_node)):
            logger.warning(
                "--nproc-per-node %d is ignored under torchrun (LOCAL_WORLD_SIZE=%s)",
                nproc_per_node,
                os.environ.get("LOCAL_WORLD_SIZE"),
            )
        if nodes.max_restarts:
            logger.warning("--max-restarts is ignored under torchrun: torchrun's own --max-restarts restarts the group")
        return _run_rank(target, args, timeout_s)
    port = nodes.port()
    port = port if port is not None else _free_port()
    envs = [nodes.rank_env(nproc_per_node, local, port) for local in range(nproc_per_node)]
    if nodes.nnodes > 1:
        logger.info(
            "node %d of %d: ranks %s..%s of %s, rendezvous at %s:%d",
            nodes.node_rank,
            nodes.nnodes,
            envs[0]["RANK"],
            envs[-1]["RANK"],
            envs[0]["WORLD_SIZE"],
            nodes.master_addr,
            port,
        )
    if nodes.max_restarts:  # even one rank is spawned: this process must outlive it to restart it
        return _restarting(target, args, nodes, nproc_per_node, timeout_s, log_level)
    if nproc_per_node == 1:
        saved = {key: os.environ.get(key) for key in envs[0]}
        os.environ.update(envs[0])
        try:
            return _run_rank(target, args, timeout_s)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return _spawn(target, args, envs, timeout_s, log_level)


def _restarting(
    target: Callable[..., Any], args: tuple, nodes: Nodes, nproc: int, timeout_s: float, log_level: str | None
) -> Any:
    restarts = nodes.max_restarts
    attempt = 0
    while True:
        port = nodes.port()
        port = port if port is not None else _free_port()  # a fresh store: nothing of the last attempt in it
        elastic = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(restarts)}
        envs = [{**nodes.rank_env(nproc, local, port), **elastic} for local in range(nproc)]
        try:
            return _spawn(target, args, envs, timeout_s, log_level)
        except RankFailure as err:
            line, _, details = str(err).partition("\n")
            if err.interrupted:
                raise
            if attempt == restarts:
                gave_up = f"{line} after {restarts} restart{'s' * (restarts != 1)} (--max-restarts {restarts})"
                raise RankFailure(gave_up + (f"\n{details}" if details else "")) from None
            attempt += 1
            logger.warning(
                "%s: restart %d of %d (--max-restarts %d), the ranks resume from the newest complete checkpoint",
                line,
                attempt,
                restarts,
                restarts,
            )
            if details:
                logger.info("the failed rank's traceback:\n%s", details)


def _threads(nproc: int) -> int:
    # The user's OMP_NUM_THREADS wins, as under torchrun; else the ranks of a host share its cores
    # evenly, which keeps them from thrashing.
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // nproc)


def _spawn(
    target: Callable[..., Any], args: tuple, envs: list[dict[str, str]], timeout_s: float, log_level: str | None
) -> Any:
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    threads = _threads(len(envs))
    first = int(envs[0]["RANK"])  # the global rank of this node's local rank 0
    procs = []
    for local, rank_env in enumerate(envs):
        rank = first + local
        env = {**rank_env, "OMP_NUM_THREADS": str(threads)}
        # Not daemonic: ranks start processes of their own (checkpoint writers).
        proc = ctx.Process(
            target=_spawned_main,
            name=f"rank{rank}",
            daemon=False,
            args=(target, args, env, os.getpid(), threads, timeout_s, log_level, first, results),
        )
        proc.start()
        procs.append(proc)
    forwarded: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGINT in forwarded:  # the second Ctrl-C: stop now
            for proc in procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
            logger.error(
                "interrupted twice: ranks stopped at once without saving; the same command resumes from "
                "the newest complete checkpoint"
            )
            os._exit(EXIT_SIGINT)
        forwarded.append(signum)
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, LAUNCHER_INTERRUPT if signum == signal.SIGINT else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    outcomes: dict[int, tuple[str, Any]] = {}
    failed: list[int] = []  # the local rank that failed first, which the launcher stopped the others for
    try:
        pending = {proc.sentinel: rank for rank, proc in enumerate(procs)}
        while pending:
            for sentinel in wait(list(pending), timeout=1.0):
                rank = pending.pop(sentinel)
                procs[rank].join()
                _drain(results, outcomes)
                if procs[rank].exitcode != 0 and not forwarded and not failed:
                    failed.append(rank)
                    _stop(procs)
        _drain(results, outcomes)
    finally:
        _stop(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _result(procs, outcomes, first, failed[0] if failed else None, bool(forwarded))


def _drain(results: mp.Queue, outcomes: dict[int, tuple[str, Any]]) -> None:
    while True:
        try:
            rank, kind, value = results.get(timeout=0.2)
        except Exception:  # queue.Empty, or a queue closed by a dead writer
            return
        outcomes[rank] = (kind, value)


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _how(rank: int, proc: Any, outcome: tuple[str, Any] | None) -> str:
    """One line: how rank ``rank`` failed, then its traceback on the next lines if it sent one."""
    if outcome is not None and outcome[0] == "error":
        text = str(outcome[1]).rstrip()
        return f"rank {rank} failed: {text.splitlines()[-1] if text else 'error'}\n{text}"
    code = proc.exitcode
    if code is not None and code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} died without a report (exit code {code})"


def _result(
    procs: list[Any], outcomes: dict[int, tuple[str, Any]], first: int, failed: int | None, interrupted: bool
) -> Any:
    errors = sorted((rank, kind, value) for rank, (kind, value) in outcomes.items() if kind != "ok")
    for _rank, kind, value in errors:
        if kind == "value_error":
            raise ValueError(value)
        if kind == "disk_full":
            raise DiskFullError(value)
    if failed is not None:  # the rank the others were stopped for, not what stopping them did to them
        raise RankFailure(_how(first + failed, procs[failed], outcomes.get(first + failed)), interrupted)
    if errors:
        rank, _, value = errors[0]
        raise RankFailure(_how(rank, procs[rank - first], (errors[0][1], value)), interrupted)
    dead = [(first + local, proc) for local, proc in enumerate(procs) if proc.exitcode != 0]
    if dead:
        raise RankFailure(_how(*dead[0], None), interrupted)
    return outcomes.get(first, ("ok", None))[1]
