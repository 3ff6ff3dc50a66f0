"""``mindspeed.nodes``: torchrun's node flags parsed and checked, and a lost peer named in one line."""

from __future__ import annotations

import argparse

import pytest

from mindspeed.nodes import DEFAULT_MASTER_PORT, Nodes, add_launch_arguments, nodes_from_args, peer_lost


def _parse(*argv: str) -> Nodes:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return nodes_from_args(parser.parse_args(list(argv)))


def test_flags_mean_what_torchruns_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert _parse() == Nodes() and Nodes().port() is None  # one node: a free port
    nodes = _parse("--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1")
    assert nodes == Nodes(3, 2, "10.0.0.1", None) and nodes.port() == DEFAULT_MASTER_PORT
    assert nodes.world_size(4) == 12
    assert _parse("--nnodes", "2", "--rdzv-endpoint", "head:1234") == Nodes(2, 0, "head", 1234)
    assert _parse("--nnodes", "2", "--rdzv-endpoint", "head").port() == DEFAULT_MASTER_PORT
    assert _parse("--max-restarts", "2") == Nodes(max_restarts=2)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert nodes.world_size(4) == 16  # under torchrun, torchrun's world


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "0"], "--nnodes=0 must be at least 1"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank=2 must be in 0..1 (--nnodes=2)"),
        (["--master-port", "70000"], "--master-port=70000 is not a port"),
        (["--nproc-per-node", "0"], "--nproc-per-node=0 must be at least 1"),
        (["--rdzv-endpoint", "h:1", "--master-port", "2"], "--rdzv-endpoint names the address and port"),
        (["--rdzv-endpoint", "h:x"], "--rdzv-endpoint='h:x': give HOST or HOST:PORT"),
        (["--max-restarts", "-1"], "--max-restarts=-1 must be at least 0"),
        (["--nnodes", "2", "--max-restarts", "1"], "--max-restarts=1 needs --nnodes 1: our static rendezvous cannot"),
    ],
)
def test_bad_flags_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _parse(*argv)


def test_a_lost_peer_is_one_line_and_other_errors_are_not_touched() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:22954: Connection reset "
        "by peer. This is typically caused by a remote worker hanging or bugs in the application. GLHF!"
    )
    lost = peer_lost(gloo, 3)
    assert str(lost) == (
        "rank 3 lost its peers (Read error [127.0.0.1]:22954: Connection reset by peer): a rank or the launcher of "
        "another node died; run the same command on every node to resume from the newest complete checkpoint"
    )
    assert peer_lost(RuntimeError("shape mismatch"), 0) is None


def test_ranks_are_numbered_as_torchrun_numbers_them() -> None:
    nodes = Nodes(nnodes=3, node_rank=1, master_addr="head")
    envs = [nodes.rank_env(4, local, 29500) for local in range(4)]
    assert [e["RANK"] for e in envs] == ["4", "5", "6", "7"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {
        (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs
    } == {("12", "4", "1", "head", "29500")}
