"""``mindspeed-rl grpo`` 's driver killed with ``kill -9`` mid-run, then the same command: same rewards, no leftovers.

The driver of a 3-step run (a tiny Llama, the math verifier plus a tiny reward model in its own
Ray worker, so rewards vary; a checkpoint every step, keep the last one) kills itself after
step 3 is logged and before it is saved. Until then it is an uninterrupted run. Every process
of the run (Ray's head, raylet, the actor, rollout and reward workers) must be gone; the same
command resumes from the step-2 checkpoint through the core's resume discovery and its step 3
equals the killed run's step 3 bit for bit (rewards, losses, gradient norm). A SIGTERM to the
resumed driver would be the same code path as the LLM trainer's (``Preemption``); the time
limit is checked here instead: ``train.exit_duration_mins`` stops after a step, saved, exit 0.

Between the two, a Ray worker is killed with ``kill -9`` at the end of a step (fault points
``rl.kill_actor``, ``rl.kill_buffer``: the driver sends the signal to the actor worker's, then the
replay buffer's process): each run ends with one line naming the worker and the newest complete
checkpoint, exit 1, Ray's traceback in ``report.txt`` only, no process left; the same command
resumes from that checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mindspeed.checkpointing import list_complete

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

#: Values of a step that must match bit for bit.
KEYS = ("reward_mean", "reward_std", "reward/model", "loss", "pg_loss", "kl_loss", "grad_norm", "response_length")


def _with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _grpo(root: Path, out: Path, *extra: str, fault: str | None = None) -> tuple[subprocess.CompletedProcess, str]:
    marker = f"MINDSPEED_RL_FAULT_TEST={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_FAULT"}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", MINDSPEED_RL_FAULT_TEST=marker.split("=")[1])
    if fault is not None:
        env["MINDSPEED_FAULT"] = fault
    args = [
        str(Path(sys.executable).parent / "mindspeed-rl"),
        "--log-level",
        "INFO",
        "grpo",
        f"actor.model={root}/hf",
        "actor.lr=2e-3",
        "actor.micro_batch_size=4",
        "data.path=demo",
        "data.prompt_format=plain",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "rollout.max_prompt_length=64",
        "train.global_batch=2",
        "train.steps=3",
        "algorithm.kl_coef=0.01",
        f"reward.model={root}/rm",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.reward_curve=false",
        f"checkpoint.save={out}",
        "checkpoint.interval=1",
        "checkpoint.keep_last=1",
        *extra,
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    # Ray's processes notice the driver's death by polling (2-3 s here; longer on a loaded host).
    deadline = time.monotonic() + 60
    while (alive := _with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = {pid: _cmdline(pid) for pid in alive}
    for pid in alive:
        os.kill(pid, 9)
    assert not alive, f"processes of the run outlived its driver by 60 s: {names}"
    return done, marker


def _steps(path: Path) -> dict[int, dict]:
    return {int(r["step"]): r for r in map(json.loads, path.read_text().splitlines()) if "step" in r}


def test_killed_driver_resumes_to_the_same_rewards(tmp_path: Path) -> None:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
    from tests.rl.driver.test_runner import _save_reward_model

    save_tiny_checkpoint("llama2", tmp_path / "hf", seed=0)
    _save_reward_model(tmp_path / "rm")
    out = tmp_path / "run"
    killed, _ = _grpo(tmp_path, out, fault="rl.step_end@3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    uninterrupted = _steps(out / "metrics.jsonl")
    assert sorted(uninterrupted) == [1, 2, 3] and uninterrupted[3]["reward_std"] > 0
    assert [p.name for p in list_complete(out)] == ["iter_0000002"]

    resumed, _ = _grpo(tmp_path, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "(step 2)" in resumed.stderr
    again = _steps(out / "metrics.jsonl")
    assert sorted(again) == [1, 2, 3]
    assert {k: again[3][k] for k in KEYS} == {k: uninterrupted[3][k] for k in KEYS}
    assert [p.name for p in list_complete(out)] == ["iter_0000003"]

    # A Ray worker killed mid-run (kill -9 of its process at the end of a step): one line naming it,
    # exit 1, Ray's traceback in report.txt only; the same command resumes from the newest checkpoint.
    command = ("train.steps=6",)
    actor_dead, _ = _grpo(tmp_path, out, *command, fault="rl.kill_actor@4")
    line = _death_line(actor_dead, out)
    assert "the actor worker rank 0 of 1 (node " in line and ", pid " in line, line
    assert "died: " in line and "after step 4 of 6" in line, line
    # The actor died before step 4's save: step 3 is the newest complete checkpoint.
    assert f"checkpoint {out / 'iter_0000003'}; run the same command to resume" in line, line
    assert [p.name for p in list_complete(out)] == ["iter_0000003"]

    buffer_dead, _ = _grpo(tmp_path, out, *command, fault="rl.kill_buffer@5")
    assert "resumed from" in buffer_dead.stderr and "(step 3)" in buffer_dead.stderr, buffer_dead.stderr[-3000:]
    line = _death_line(buffer_dead, out)
    assert "the replay buffer (node " in line and "after step 5 of 6" in line, line
    assert f"checkpoint {out / 'iter_0000005'}; run the same command to resume" in line, line
    assert [p.name for p in list_complete(out)] == ["iter_0000005"]

    # The time limit: one more step, saved, exit 0, one line; the same command would resume.
    limited, _ = _grpo(tmp_path, out, "train.steps=7", "train.exit_duration_mins=1e-6")
    assert limited.returncode == 0 and "Traceback" not in limited.stderr, limited.stderr[-3000:]
    assert "resumed from" in limited.stderr and "(step 5)" in limited.stderr
    (line,) = [x for x in limited.stderr.splitlines() if "stopped by" in x]
    assert "stopped by the time limit" in line and "after step 6 of 7" in line
    assert f"checkpoint {out / 'iter_0000006'}; run the same command to resume" in line
    assert [p.name for p in list_complete(out)] == ["iter_0000006"]


def _death_line(done: subprocess.CompletedProcess, out: Path) -> str:
    """The one line of a run ended by a dead Ray worker (exit 1, no traceback on the console)."""
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ray.exceptions" not in done.stderr, done.stderr[-3000:]
    errors = [x for x in done.stderr.splitlines() if " ERROR " in x or "Error" in x]
    assert len(errors) == 1, done.stderr[-3000:]
    report = (out / "report.txt").read_text()
    assert "Traceback" in report and "ActorDiedError" in report
    assert f"(Ray's traceback: {out / 'report.txt'})" in errors[0]
    return errors[0]
