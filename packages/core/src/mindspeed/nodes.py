"""Where a launcher's ranks sit among the nodes of a run: torchrun's ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port`` (or ``--rdzv-endpoint HOST:PORT``), with torchrun's meaning.

Every training command adds these flags with :func:`add_launch_arguments` and hands
:func:`nodes_from_args`'s answer to :func:`mindspeed.launch.launch`. One launcher runs on every
node, each with its node rank; the ranks of node ``n`` are ``n * nproc_per_node + local_rank``
(torchrun's static rendezvous: node ranks are given, not assigned on arrival) and meet at
``MASTER_ADDR:MASTER_PORT``, where global rank 0 (on node 0) serves the c10d store. Under
``torchrun`` the flags are ignored: torchrun placed this process already.

``--max-restarts N`` (torchrun's meaning): when a rank fails, the launcher stops this node's ranks
and starts them again, up to N times; they resume from the newest complete checkpoint. It needs one
node: a static rendezvous cannot make the other nodes' launchers restart their ranks too (torchrun's
c10d rendezvous can: run torchrun with ``--max-restarts`` there).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

#: What gloo (and the c10d store) say when the other end of a connection died.
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused", "Socket Timeout")


class PeerLost(RuntimeError):
    """A collective failed because another rank (another node's launcher or rank) died; one line."""


class RankFailure(RuntimeError):
    """A spawned rank failed; the message's first line names the rank and how, the rest is its traceback.

    Attributes:
        interrupted: the launcher itself was sent SIGTERM or SIGINT (a preemption: never restarted).
    """

    def __init__(self, message: str, interrupted: bool = False) -> None:
        super().__init__(message)
        self.interrupted = interrupted


def peer_lost(err: BaseException, rank: int) -> PeerLost | None:
    """The :class:`PeerLost` ``err`` stands for (a collective or store whose peer went away), else ``None``."""
    text = str(err)
    if type(err).__name__ != "DistNetworkError" and not any(mark in text for mark in _PEER_GONE):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]  # gloo's source location, advice
    return PeerLost(
        f"rank {rank} lost its peers ({first[:200]}): a rank or the launcher of another node died; run the same "
        "command on every node to resume from the newest complete checkpoint"
    )


#: torchrun's default port of the rendezvous when there are several nodes.
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Nodes:
    """This launcher's place in a run of ``nnodes`` nodes.

    Attributes:
        nnodes: nodes of the run, each with one launcher and ``nproc_per_node`` ranks.
        node_rank: this node's rank, 0 .. nnodes - 1; node 0 hosts global rank 0 (the c10d store).
        master_addr: the address of node 0 every node can reach (``127.0.0.1``: one host).
        master_port: the port of the store on node 0 (``None``: a free one with one node, 29500 with several).
        max_restarts: times the launcher restarts its ranks after one failed (torchrun's ``--max-restarts``;
            one node only).
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes={self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in 0..{self.nnodes - 1} (--nnodes={self.nnodes})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port={self.master_port} is not a port: give one in 1..65535")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts={self.max_restarts} must be at least 0")
        if self.max_restarts and self.nnodes > 1:
            raise ValueError(
                f"--max-restarts={self.max_restarts} needs --nnodes 1: our static rendezvous cannot restart the other "
                "nodes' ranks; on several nodes run torchrun --rdzv-backend c10d --max-restarts N, or let the "
                "scheduler rerun the command (docs/scale-out.md)"
            )

    def world_size(self, nproc_per_node: int) -> int:
        """The ranks of the whole run: torchrun's ``WORLD_SIZE`` under torchrun, else nodes x ranks per node."""
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return int(os.environ["WORLD_SIZE"])
        return self.nnodes * nproc_per_node

    def rank_env(self, nproc_per_node: int, local_rank: int, port: int) -> dict[str, str]:
        """The variables torchrun would give local rank ``local_rank`` of this node (rendezvous on ``port``)."""
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(self.nnodes * nproc_per_node),
            "LOCAL_WORLD_SIZE": str(nproc_per_node),
            "GROUP_RANK": str(self.node_rank),
            "RANK": str(self.node_rank * nproc_per_node + local_rank),
            "LOCAL_RANK": str(local_rank),
        }

    def port(self) -> int | None:
        """The rendezvous port: the one given, torchrun's default with several nodes, ``None`` (pick one) with one."""
        if self.master_port is not None:
            return self.master_port
        return DEFAULT_MASTER_PORT if self.nnodes > 1 else None


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--nproc-per-node``, ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``,
    ``--rdzv-endpoint`` and ``--max-restarts`` (torchrun's flags; all ignored under torchrun)."""
    group = parser.add_argument_group("ranks and nodes (torchrun's flags; ignored under torchrun)")
    group.add_argument("--nproc-per-node", type=int, default=1, help="ranks to spawn on this node (default 1)")
    group.add_argument("--nnodes", type=int, default=1, help="nodes of the run, one launcher on each (default 1)")
    group.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default 0)")
    group.add_argument(
        "--master-addr", default=None, help="address of node 0, reachable from every node (default 127.0.0.1)"
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="port of the rendezvous on node 0 (default 29500 with --nnodes > 1)",
    )
    group.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST[:PORT]", help="--master-addr and --master-port in one"
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the ranks up to N times after one fails; they resume from the newest complete checkpoint "
        "(default 0; one node only)",
    )


def nodes_from_args(args: argparse.Namespace) -> Nodes:
    """The :class:`Nodes` of parsed :func:`add_launch_arguments` flags.

    Raises:
        ValueError: a flag out of range, or ``--rdzv-endpoint`` given with ``--master-addr`` / ``--master-port``.
    """
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} must be at least 1")
    addr, port = args.master_addr, args.master_port
    if args.rdzv_endpoint is not None:
        if addr is not None or port is not None:
            raise ValueError("--rdzv-endpoint names the address and port: drop --master-addr / --master-port")
        host, _, text = (
            args.rdzv_endpoint.rpartition(":") if ":" in args.rdzv_endpoint else (args.rdzv_endpoint, "", "")
        )
        if not host or (text and not text.isdigit()):
            raise ValueError(f"--rdzv-endpoint={args.rdzv_endpoint!r}: give HOST or HOST:PORT")
        addr, port = host, int(text) if text else None
    return Nodes(args.nnodes, args.node_rank, addr or "127.0.0.1", port, args.max_restarts)
