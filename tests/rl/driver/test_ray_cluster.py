"""``mindspeed-rl grpo`` on a Ray cluster of two nodes, on one host: pools pinned by node resources.

The test starts a cluster the way ``ray start`` does, with Ray's own multi-node test harness
(``ray.cluster_utils.Cluster``: a head and a second raylet, separate processes, one CPU each):
the head offers the custom resource ``node_a``, the second node ``node_b``. The driver runs as
its own process and joins it (``ray.address``), with ``ray.pool_resources`` pinning the actor
pool to ``node_a`` and the separated rollout pool to ``node_b``:

- the two pools land on the two nodes (the driver logs each pool's node ids), so the weights go
  from the actor to the rollout engine across nodes, through Ray's object store;
- the driver is killed with ``kill -9`` after step 2 is logged (fault point ``rl.step_end@2``,
  step 1 saved); the cluster is then left clean: every resource the run reserved is free again
  and none of its actors is alive;
- the same command resumes from step 1 on the cluster and its step 2 equals the killed run's
  step 2 bit for bit;
- both steps equal a single-node run of the same recipe (a local Ray instance, no pinning) bit
  for bit: where the pools run changes no number (every request carries its own seed).

Cost: two driver processes on the cluster (one killed), one run in this process, one cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

#: Values of a step that must match bit for bit.
KEYS = ("reward_mean", "reward_std", "loss", "pg_loss", "grad_norm", "response_length")
#: A 2-step GRPO run with a separated rollout pool of one engine, saved every step.
RECIPE = (
    "actor.lr=2e-3",
    "actor.micro_batch_size=4",
    "data.path=demo",
    "data.prompt_format=plain",
    "rollout.n=2",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_length=64",
    "rollout.colocate=false",
    "rollout.num_devices=1",
    "train.global_batch=2",
    "train.steps=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.reward_curve=false",
    "checkpoint.interval=1",
)
PINNED = "ray.pool_resources={actor: {node_a: 1}, rollout: {node_b: 1}}"


def _steps(log_dir: Path) -> dict[int, dict[str, float]]:
    records = map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())
    return {int(r["step"]): r for r in records if r["step"] > 0}


def _driver(args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    from mindspeed_rl.driver.ray_runtime import OWNER_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_FAULT", OWNER_ENV, "RAY_ADDRESS")}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    if fault:
        env["MINDSPEED_FAULT"] = fault
    command = [str(Path(sys.executable).parent / "mindspeed-rl"), "--log-level", "INFO", "grpo", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("cluster")
    save_tiny_checkpoint("llama2", path / "hf", seed=0)
    return path


def test_pools_pinned_to_nodes_kill_and_resume(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    base = [f"actor.model={root}/hf", *RECIPE]
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1})
        cluster.wait_for_nodes()
        args = [*base, f"ray.address={cluster.address}", PINNED, f"checkpoint.save={root}/ckpt"]
        killed = _driver(args, fault="rl.step_end@2")
        assert killed.returncode == -9 or killed.returncode == 137, killed.stderr[-3000:]
        pools = dict(re.findall(r"the (actor|rollout) pool: 1 workers on node\(s\) (\w+)", killed.stderr))
        assert set(pools) == {"actor", "rollout"} and pools["actor"] != pools["rollout"], killed.stderr[-3000:]
        nodes = {n["NodeID"]: n["Resources"] for n in _nodes(cluster)}
        assert "node_a" in nodes[pools["actor"]] and "node_b" in nodes[pools["rollout"]]
        first = _steps(root / "ckpt")
        assert sorted(first) == [1, 2]

        # The cluster is left clean: every reserved resource free again, none of the run's actors alive.
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            deadline = time.monotonic() + 60
            while ray.available_resources() != ray.cluster_resources() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert ray.available_resources() == ray.cluster_resources()
            from ray._private.state import actors

            assert not [a for a, info in actors().items() if info.get("State") != "DEAD"]
        finally:
            ray.shutdown()

        resumed = _driver(args)  # the same command: resumes from step 1 on the cluster
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from" in resumed.stderr
        again = _steps(root / "ckpt")
        for key in KEYS:
            assert again[2][key] == first[2][key], (key, again[2][key], first[2][key])
    finally:
        cluster.shutdown()

    # A single-node run of the same recipe (local Ray instance, nothing pinned) in this process.
    from mindspeed_rl.cli import main
    from mindspeed_rl.driver.ray_runtime import init_ray

    init_ray(num_cpus=2)
    try:
        assert main(["grpo", *base, f"checkpoint.save={root}/single"]) == 0
    finally:
        ray.shutdown()
    single = _steps(root / "single")
    for step in (1, 2):
        for key in KEYS:
            assert first[step][key] == single[step][key], (step, key, first[step][key], single[step][key])


def _nodes(cluster: Any) -> list[dict[str, Any]]:
    """The cluster's nodes as ``ray.nodes()`` reports them (a short-lived connection)."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        return ray.nodes()
    finally:
        ray.shutdown()
