"""Two "nodes" on one host: two ``mindspeed-llm pretrain`` launchers with ``--nnodes 2`` and node ranks 0
and 1 (one gloo rank each) meeting at a rendezvous on localhost, against one launcher with
``--nproc-per-node 2``.

One save directory lives through a chain, as a run on a cluster with shared storage would: SIGTERM
to node 1's launcher (both nodes stop after the same step, save, exit 143), ``kill -9`` of node 1's
launcher (node 0's rank fails within :data:`PEER_LOSS_S` instead of hanging), then the same two
commands run to the end. The whole run's losses, learning rates and gradient norms equal the
single-launcher run's bit for bit, and so do two plain ``torchrun --nnodes 2`` agents running the
same command (docs/scale-out.md).
"""

from __future__ import annotations

import importlib
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mindspeed.checkpointing import LOCK_FILE, list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

#: Seconds within which node 0 ends after node 1's launcher was killed (docs/scale-out.md): gloo sees the
#: peer's connections close. A node that vanishes without closing them is bounded by the collective timeout.
PEER_LOSS_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _nodes(args: list[str], port: int, faults: tuple[str | None, str | None] = (None, None)) -> list[subprocess.Popen]:
    flags = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [harness.start([*args, *flags, "--node-rank", str(rank)], fault) for rank, fault in enumerate(faults)]


def test_two_nodes_match_one_launcher_stop_together_and_survive_a_lost_node(
    tmp_path: Path, dataset: str, two_ranks: Path
) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out))
    port = _free_port()
    # SIGTERM to node 1's launcher after step 3: both nodes finish step 3, save it, and exit 143.
    node0, node1 = (harness.finish(p) for p in _nodes(args, port, (None, "train.step_end@3=SIGTERM")))
    assert "node 1 of 2: ranks 1..1 of 2, rendezvous at 127.0.0.1" in node1.stderr, node1.stderr[-3000:]
    for done in (node0, node1):  # global rank 0 (node 0) logs the run; node 1 says little
        assert done.returncode == 143, done.stderr[-3000:]
    (line,) = node0.lines("stopped by")
    assert "stopped by SIGTERM after step 3 of 10" in line and str(out / "iter_0000003") in line
    assert out / "iter_0000003" in list_complete(out) and not (out / LOCK_FILE).exists()

    # kill -9 of node 1's launcher at the start of step 5: node 0 ends on its own, with no rank left.
    procs = _nodes(args, port, (None, "train.step_start@5"))
    lost = harness.finish(procs[1])
    assert lost.returncode == -signal.SIGKILL, lost.stderr[-3000:]
    start = time.monotonic()
    survivor = harness.finish(procs[0], timeout=PEER_LOSS_S + 60)
    waited = time.monotonic() - start
    assert survivor.returncode == 1 and waited < PEER_LOSS_S, (waited, survivor.stderr[-3000:])
    (line,) = survivor.lines("lost its peers")
    assert "rank 0 lost its peers (" in line and "run the same command on every node" in line
    assert "Traceback" not in survivor.stderr, survivor.stderr[-3000:]
    assert survivor.resumed_step == 3, survivor.stderr[-3000:]
    assert max(p.name for p in list_complete(out)) == "iter_0000004"

    # The same two commands resume from the newest complete checkpoint and run to the end.
    node0, node1 = (harness.finish(p) for p in _nodes(args, port))
    assert node0.resumed_step == 4, node0.stderr[-3000:]
    for done in (node0, node1):
        assert done.returncode == 0, done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(two_ranks / "metrics.jsonl")
    print(f"node 0 ended {waited:.1f} s after node 1's launcher was killed")


def test_plain_torchrun_on_two_nodes_matches_one_launcher(tmp_path: Path, dataset: str, two_ranks: Path) -> None:
    # torchrun --nnodes 2 --rdzv-backend c10d ... $(which mindspeed-llm) pretrain ...: the command is one rank of
    # it; the c10d rendezvous hands out the node ranks as the agents arrive.
    out = tmp_path / "run"
    exe, *rest = harness.command(*harness.recipe(dataset, out))
    torchrun = str(Path(exe).parent / "torchrun")
    endpoint = f"127.0.0.1:{_free_port()}"
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    procs = [harness.start([torchrun, *flags, "--rdzv-id", "two-nodes", exe, *rest]) for _ in range(2)]
    for done in [harness.finish(p) for p in procs]:
        assert done.returncode == 0, done.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(two_ranks / "metrics.jsonl")
    assert {f"iter_{s:07d}" for s in range(2, harness.STEPS + 1, 2)} <= {p.name for p in list_complete(out)}


@pytest.mark.parametrize(
    ("suite", "command"),
    [("llm", "pretrain"), ("llm", "sft"), ("llm", "dpo"), ("llm", "rm"), ("mm", "train"), ("mm", "extract-features")],
)
def test_every_training_command_takes_the_node_flags(
    suite: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"mindspeed_{suite}.cli").main
    assert main([command, "--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert err == f"mindspeed-{suite}: error: --node-rank=2 must be in 0..1 (--nnodes=2)\n"
