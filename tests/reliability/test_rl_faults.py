"""``mindspeed-rl grpo`` and ``mindspeed-rl ppo`` drivers killed with ``kill -9`` mid-run, then the
same command: the same numbers, no leftovers.

GRPO (a tiny Llama, the math verifier plus a tiny reward model in its own Ray worker, so rewards
vary; 4 steps, a checkpoint every step, keep the last one): the driver kills itself after step 2
is logged and before it is saved. Until then it is an uninterrupted run. Every process of the
run (Ray's head, raylet, the actor, rollout and reward workers) must be gone; the same command
resumes from the step-1 checkpoint through the core's resume discovery and its step 2 equals the
killed run's step 2 bit for bit (rewards, losses, gradient norm). That resumed run also carries
``train.exit_duration_mins`` (the time limit, checked here instead of a SIGTERM to the driver,
which is the LLM trainer's ``Preemption`` code path): it stops after its step, saved, exit 0,
one line. Then the actor worker is killed with ``kill -9`` at the end of step 3 (fault point
``rl.kill_actor``: the driver sends the signal to that worker's process): the run ends with one
line naming the worker and the newest complete checkpoint (step 2), exit 1, Ray's traceback in
``report.txt`` only, none of the run's workers left.

PPO (the same Llama as actor and critic, the math verifier, KL in the reward with the adaptive
controller; 3 steps): the driver killed after step 2 is logged (step 1 saved: actor, critic,
controller), the same command resumes from step 1 and its step 2 equals the killed run's bit
for bit, the critic's metrics (``critic/vf_loss`` ...) and the controller's coefficient
included. That resumed run also has its replay buffer killed with ``kill -9`` at the end of step
2 (``rl.kill_buffer``): step 2 is still saved (actor and critic), step 3 finds the buffer dead:
one line naming the replay buffer and ``iter_0000002``, exit 1.

Cost: 5 runs, 6 steps in all. Only the two killed drivers run as their own processes (their
own Ray instances: that they leave nothing behind is under test), both first; the run after each kill is
the same command through the CLI's ``main`` in the test's process, on one Ray instance for the
module (the run's workers must be gone after it): no second start of the driver's imports and
of Ray per run. Measured with every process of the run counted, Ray's included, on a shared
2-core host, side by side with the previous GRPO-only version of this file (5 driver processes,
8 steps): 122 s of CPU against 170 s (alone, under loads of 15-28: 116-154 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from mindspeed.checkpointing import list_complete

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

#: Values of a GRPO step that must match bit for bit.
KEYS = ("reward_mean", "reward_std", "reward/model", "loss", "pg_loss", "kl_loss", "grad_norm", "response_length")
#: Values of a PPO step that must match bit for bit (the critic's and the KL controller's included).
PPO_KEYS = (
    "reward_mean",
    "response_length",
    "loss",
    "pg_loss",
    "grad_norm",
    "kl_in_reward",
    "kl_coef",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/vf_explained_var",
    "critic/returns_mean",
    "critic/values_mean",
    "critic/advantages_mean",
    "critic/grad_norm",
)
#: The recipe both algorithms share (one optimizer step per training step, 2 prompts x 2 samples).
COMMON = (
    "actor.lr=2e-3",
    "actor.micro_batch_size=4",
    "data.path=demo",
    "data.prompt_format=plain",
    "rollout.n=2",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_length=64",
    "train.global_batch=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.reward_curve=false",
    "checkpoint.interval=1",
    "checkpoint.keep_last=1",
)
#: PPO: KL in the reward through the adaptive controller (its state is part of the resume), a critic.
PPO = (
    "train.steps=3",
    "critic.lr=1e-3",
    "algorithm.kl_coef=0.0",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.05",
    "algorithm.kl_ctrl.horizon=10",
)


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


def _args(command: str, root: Path, out: Path, *extra: str) -> list[str]:
    """``mindspeed-rl``'s arguments: the recipe of ``command`` (grpo: with the reward model) plus ``extra``."""
    if command == "grpo":
        extra = ("train.steps=4", "algorithm.kl_coef=0.01", f"reward.model={root}/rm", *extra)
    else:
        extra = (*PPO, *extra)
    return ["--log-level", "INFO", command, f"actor.model={root}/hf", *COMMON, f"checkpoint.save={out}", *extra]


def _killed(command: str, root: Path, out: Path, fault: str) -> subprocess.CompletedProcess:
    """The driver as its own process, killed by fault point ``fault``; no process of the run may outlive it."""
    marker = f"MINDSPEED_RL_FAULT_TEST={uuid.uuid4().hex}"
    from mindspeed_rl.driver.ray_runtime import OWNER_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_FAULT", OWNER_ENV)}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", MINDSPEED_RL_FAULT_TEST=marker.split("=")[1])
    env["MINDSPEED_FAULT"] = fault
    args = [str(Path(sys.executable).parent / "mindspeed-rl"), *_args(command, root, out)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    # Ray's processes notice the driver's death by polling (2-3 s here; longer on a loaded host).
    deadline = time.monotonic() + 60
    while (alive := _with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = {pid: _cmdline(pid) for pid in alive}
    for pid in alive:
        os.kill(pid, 9)
    assert not alive, f"processes of the run outlived its driver by 60 s: {names}"
    return done


@pytest.fixture(scope="module")
def killed(root: Path) -> dict[str, subprocess.CompletedProcess]:
    """Both killed drivers (grpo, ppo: killed after step 2 is logged), run before this process starts its
    own Ray instance: one instance at a time starts on the 2-core host."""
    return {command: _killed(command, root, root / command, "rl.step_end@2") for command in ("grpo", "ppo")}


@pytest.fixture(scope="module")
def ray_session(killed: dict[str, subprocess.CompletedProcess]) -> Any:
    """One Ray instance for the runs that are not killed (their drivers run in this process): its marker."""
    from mindspeed_rl.driver.ray_runtime import OWNER_ENV, init_ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # inherited by the instance's workers
        ray = init_ray(num_cpus=4)
        marker = f"{OWNER_ENV}={os.environ[OWNER_ENV]}"
    yield marker
    ray.shutdown()


def _same_command(
    capfd: pytest.CaptureFixture[str],
    session: str,
    command: str,
    root: Path,
    out: Path,
    *extra: str,
    fault: str | None = None,
) -> tuple[int, str]:
    """``mindspeed-rl`` in this process (the CLI's ``main``) with ``MINDSPEED_FAULT=fault``: exit code, stderr.

    Afterwards no worker of the run is left in the module's Ray instance (only Ray's own processes)."""
    from mindspeed_rl.cli import main

    capfd.readouterr()
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MINDSPEED_FAULT", raising=False)
        if fault is not None:
            env.setenv("MINDSPEED_FAULT", fault)
        code = main(_args(command, root, out, *extra))
    err = capfd.readouterr().err
    deadline = time.monotonic() + 60
    while (left := _workers(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"workers of the run outlived it by 60 s: {left}"
    return code, err


def _workers(session: str) -> list[str]:
    """The Ray actors' processes of the instance marked ``session`` (not Ray's idle workers and agents)."""
    names = [_cmdline(pid) for pid in _with_marker(session)]
    own = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
    return [n for n in names if n.startswith("ray::") and not n.startswith(own)]


def _steps(path: Path) -> dict[int, dict]:
    return {int(r["step"]): r for r in map(json.loads, path.read_text().splitlines()) if "step" in r}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
    from tests.rl.driver.test_runner import _save_reward_model

    path = tmp_path_factory.mktemp("rl_faults")
    save_tiny_checkpoint("llama2", path / "hf", seed=0)
    _save_reward_model(path / "rm")
    return path


def test_killed_driver_resumes_to_the_same_rewards(
    root: Path, killed: dict[str, subprocess.CompletedProcess], ray_session: str, capfd: pytest.CaptureFixture[str]
) -> None:
    out = root / "grpo"
    assert killed["grpo"].returncode == -9, killed["grpo"].stderr[-3000:]
    uninterrupted = _steps(out / "metrics.jsonl")
    assert sorted(uninterrupted) == [1, 2] and uninterrupted[2]["reward_std"] > 0
    assert [p.name for p in list_complete(out)] == ["iter_0000001"]

    # The same command (with a time limit: one step, saved, exit 0, one line) resumes from step 1.
    code, err = _same_command(capfd, ray_session, "grpo", root, out, "train.exit_duration_mins=1e-6")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "resumed from" in err and "(step 1)" in err
    again = _steps(out / "metrics.jsonl")
    assert sorted(again) == [1, 2]
    assert {k: again[2][k] for k in KEYS} == {k: uninterrupted[2][k] for k in KEYS}
    (line,) = [x for x in err.splitlines() if "stopped by" in x]
    assert "stopped by the time limit" in line and "after step 2 of 4" in line, line
    assert f"checkpoint {out / 'iter_0000002'}; run the same command to resume" in line, line
    assert [p.name for p in list_complete(out)] == ["iter_0000002"]

    # A Ray worker killed mid-run (kill -9 of its process at the end of a step): one line naming it,
    # exit 1, Ray's traceback in report.txt only; the same command resumes from the newest checkpoint.
    code, err = _same_command(capfd, ray_session, "grpo", root, out, fault="rl.kill_actor@3")
    assert "resumed from" in err and "(step 2)" in err, err[-3000:]
    line = _death_line(code, err, out)
    assert "the actor worker rank 0 of 1 (node " in line and ", pid " in line, line
    assert "died: " in line and "after step 3 of 4" in line, line
    # The actor died before step 3's save: step 2 is the newest complete checkpoint.
    assert f"checkpoint {out / 'iter_0000002'}; run the same command to resume" in line, line
    assert [p.name for p in list_complete(out)] == ["iter_0000002"]


def test_killed_ppo_driver_resumes_with_its_critic(
    root: Path, killed: dict[str, subprocess.CompletedProcess], ray_session: str, capfd: pytest.CaptureFixture[str]
) -> None:
    out = root / "ppo"
    assert killed["ppo"].returncode == -9, killed["ppo"].stderr[-3000:]
    uninterrupted = _steps(out / "metrics.jsonl")
    assert sorted(uninterrupted) == [1, 2]
    assert uninterrupted[2]["grad_norm"] > 0 and uninterrupted[2]["critic/grad_norm"] > 0
    assert uninterrupted[2]["kl_coef"] != uninterrupted[1]["kl_coef"]  # the controller moved: its state resumes
    assert [p.name for p in list_complete(out)] == ["iter_0000001"]
    assert [p.name for p in list_complete(out / "critic")] == ["iter_0000001"]

    # The same command resumes from step 1 (actor, critic, controller, sampler); its replay buffer is
    # killed at the end of step 2: step 2 is saved, step 3 finds the buffer dead.
    code, err = _same_command(capfd, ray_session, "ppo", root, out, fault="rl.kill_buffer@2")
    assert "resumed from" in err and "(step 1)" in err, err[-3000:]
    again = _steps(out / "metrics.jsonl")
    assert sorted(again) == [1, 2]
    assert {k: again[2][k] for k in PPO_KEYS} == {k: uninterrupted[2][k] for k in PPO_KEYS}
    line = _death_line(code, err, out)
    assert "the replay buffer (node " in line and "after step 2 of 3" in line, line
    assert f"checkpoint {out / 'iter_0000002'}; run the same command to resume" in line, line
    assert [p.name for p in list_complete(out)] == ["iter_0000002"]
    assert (out / "critic" / "iter_0000002").is_dir()


def _death_line(code: int, err: str, out: Path) -> str:
    """The one line of a run ended by a dead Ray worker (exit 1, no traceback on the console)."""
    assert code == 1, err[-3000:]
    assert "Traceback" not in err and "ray.exceptions" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if " ERROR " in x or "Error" in x]
    assert len(errors) == 1, err[-3000:]
    report = (out / "report.txt").read_text()
    assert "Traceback" in report and "ActorDiedError" in report
    assert f"(Ray's traceback: {out / 'report.txt'})" in errors[0]
    return errors[0]
