"""``mindspeed-rl ppo`` on Ray: two steps with a co-located critic, a checkpoint, a bit-equal resume.

One local Ray instance, a tiny Llama (actor, critic from the same directory with a fresh value
head, frozen reference for the KL in the reward), the shipped arithmetic prompts:

- ``mindspeed-rl ppo``, 2 steps (critic.warmup_steps 1: step 1 trains the critic alone, step 2 both) saving a
  checkpoint after every step: every critic metric is finite, the critic moved the values
  (``critic/vf_loss`` > 0, a gradient), the actor did not update in the warmup step and did in
  step 2, the adaptive KL controller's coefficient is recorded, and each checkpoint holds the
  critic (``critic/iter_<step>``) and the controller's state (``rl_state.json``); a held-out
  evaluation runs before each save (its rollout offloads the critic: the save onloads it);
- resume: the step-2 run checkpoint removed, the same command with ``critic.colocate=false`` (the
  critic in a pool and process group of its own) resumes from step 1 (actor, critic, KL
  controller) and its step 2 equals the uninterrupted co-located step 2 exactly, critic metrics
  included: where the critic lives changes no number; without the critic's directory the
  command exits 2 with one line.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

#: Step metrics the resumed step must repeat exactly.
KEYS = (
    "reward_mean",
    "response_length",
    "loss",
    "grad_norm",
    "kl_in_reward",
    "kl_coef",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/vf_explained_var",
    "critic/returns_mean",
    "critic/values_mean",
    "critic/grad_norm",
)


def _recipe(root: Path) -> list[str]:
    return [
        f"actor.model={root}/hf",
        "actor.lr=2e-3",
        "actor.micro_batch_size=3",
        "critic.lr=1e-3",
        "critic.warmup_steps=1",
        "data.path=demo",
        "data.prompt_format=plain",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "rollout.max_prompt_length=64",
        "train.global_batch=3",
        "train.steps=2",
        "algorithm.kl_coef=0.0",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.horizon=10",
        f"checkpoint.save={root}/ckpt",
        "checkpoint.interval=1",
        # A held-out evaluation after every step: its rollout offloads the critic (co-location)
        # right before the save, which must bring it back first.
        "data.eval_path=demo-test",
        "train.eval_interval=1",
        "train.eval_temperature=0",
        "logging.progress=false",
        f"logging.dir={root}/logs",
    ]


def _run(root: Path, *extra: str) -> list[dict[str, float]]:
    """``mindspeed-rl ppo`` with the recipe; the step records of its metrics.jsonl (exit status 0 checked)."""
    from mindspeed_rl.cli import main

    assert main(["ppo", *_recipe(root), *extra]) == 0
    lines = (root / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] > 0]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("ppo")
    save_tiny_checkpoint("llama2", path / "hf", seed=0)
    return path


@pytest.fixture(scope="module")
def ray_session() -> Any:
    from mindspeed_rl.driver.ray_runtime import init_ray

    ray = init_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def test_two_steps_checkpoint_and_resume(ray_session: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = _run(root)
    assert [r["step"] for r in records] == [1.0, 2.0]
    assert all("eval/reward_mean" in r for r in records)
    for record in records:
        for key in KEYS[4:]:
            assert math.isfinite(record[key]), (key, record[key])
        assert record["critic/vf_loss"] > 0 and record["critic/grad_norm"] > 0
    assert records[0]["critic/warmup"] == 1.0 and "loss" not in records[0]  # the critic alone
    assert records[1]["critic/warmup"] == 0.0 and records[1]["grad_norm"] > 0
    save = root / "ckpt"
    for step in (1, 2):
        assert (save / "critic" / f"iter_{step:07d}").is_dir()
        state = json.loads((save / f"iter_{step:07d}" / "rl_state.json").read_text())
        assert state["kl_ctrl"]["value"] > 0
    # Step 1's KL is 0 (the policy is the reference): the adaptive controller lowered beta for step 2.
    assert records[1]["kl_coef"] < records[0]["kl_coef"] == 0.05
    shutil.rmtree(save / "iter_0000002")
    capsys.readouterr()
    resumed = _run(root, "critic.colocate=false")  # resumes from step 1, the critic in its own pool
    assert "the critic runs in its own pool: 1 workers" in capsys.readouterr().err
    assert [r["step"] for r in resumed] == [1.0, 2.0] and resumed[0] == records[0]  # step 1's line kept
    for key in KEYS:
        assert resumed[1][key] == records[1][key], (key, resumed[1][key], records[1][key])
    # A run checkpoint without its critic: one line, exit 2, before any worker starts.
    from mindspeed_rl.cli import main

    shutil.rmtree(save / "critic" / "iter_0000002")
    capsys.readouterr()
    assert main(["ppo", *_recipe(root)]) == 2
    err = capsys.readouterr().err
    assert "has no critic" in err and "Traceback" not in err
