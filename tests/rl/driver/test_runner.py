"""The Ray driver (``GRPORunner``) against the single-process GRPO loop, the unsharded and the uninterrupted run.

One local Ray instance for the module, a tiny Llama, the shipped arithmetic prompts with the
math verifier plus a tiny reward model (in its own Ray worker; in-process for the reference), so
the rewards vary and no update is zero (Adam would blow rounding noise of a zero gradient up
into a real step and make layouts incomparable):

- reference: ``train_grpo`` in one spawned process (actor, engine, reference all local);
- separated sync run (actor on one worker, the engine on a rollout worker) with the rollout
  worker killed after step 1 and checkpoints every 2 steps: every step's samples, rewards,
  losses and gradient norms equal the reference's (the restarted worker got the current
  weights and regenerated with the same seeds);
- resume: a new runner on the same checkpoint directory (newest checkpoint removed, so it
  resumes from step 2) redoes step 3 with the same numbers;
- co-located run with the actor at TP2 and the rollout engine at TP1: the engine's
  log-probs of its own samples equal the actor's after every weight sync (resharding), and the
  steps equal the reference's (TP2 vs unsharded, relative 1e-4);
- async run (actor DP2, one rollout worker, max_staleness 1): the rollout ran ahead (staleness
  1 after the first step), never more than the bound, truncated importance sampling is on, and
  step 1 (same weights, same seeds) equals the reference's.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS = 3
KEYS = ("reward_mean", "reward_std", "reward/model", "response_length", "loss", "pg_loss", "kl_loss", "grad_norm")


def _recipe(root: Path, *extra: str) -> list[str]:
    return [
        f"actor.model={root}/hf",
        "actor.lr=2e-3",
        "actor.micro_batch_size=4",
        "data.path=demo",
        "data.prompt_format=plain",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "rollout.max_prompt_length=64",
        "train.global_batch=2",
        f"train.steps={STEPS}",
        "algorithm.kl_coef=0.01",
        f"reward.model={root}/rm",
        "logging.progress=false",
        *extra,
    ]


def _reference(rank: int, world_size: int, overrides: list[str]) -> list[dict[str, float]]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.trainer import train_grpo

    return train_grpo(load_grpo_config(None, overrides))


def _close(got: dict[str, float], want: dict[str, float], rel: float) -> None:
    for key in KEYS:
        assert math.isclose(got[key], want[key], rel_tol=rel, abs_tol=1e-6), (key, got[key], want[key])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("runner")
    save_tiny_checkpoint("llama2", path / "hf", seed=0)
    _save_reward_model(path / "rm")
    return path


def _save_reward_model(path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(path.parent / "hf")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def reference(root: Path) -> list[dict[str, float]]:
    records = run_distributed(_reference, 1, _recipe(root), timeout=400)[0]
    assert min(r["reward_std"] for r in records) > 0 and min(r["grad_norm"] for r in records) > 0
    return records


@pytest.fixture(scope="module")
def ray_session() -> Any:
    from mindspeed_rl.driver.ray_runtime import init_ray

    ray = init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


def _run(overrides: list[str], kill_after: int | None = None) -> tuple[list[dict[str, float]], Any]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.runner import GRPORunner

    runner = GRPORunner(load_grpo_config(None, overrides))
    try:
        records = []
        if kill_after is not None:
            import ray

            records += runner.run(steps=kill_after)
            ray.kill(runner.rollout.workers[0], no_restart=False)
        records += runner.run()
        return records, runner
    finally:
        runner.shutdown()


def test_separated_with_killed_rollout_worker_and_resume(
    ray_session: Any, root: Path, reference: list[dict[str, float]]
) -> None:
    save = root / "ckpt"
    overrides = _recipe(
        root, "rollout.colocate=false", "rollout.num_devices=1", f"checkpoint.save={save}", "checkpoint.interval=2"
    )
    records, runner = _run(overrides, kill_after=1)
    assert runner.rollout.recoveries >= 1  # the killed worker was restarted and refilled
    assert [r["step"] for r in records] == [1.0, 2.0, 3.0]
    for got, want in zip(records, reference):
        _close(got, want, 1e-5)
        assert got["rollout_logp_diff"] < 1e-4
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_"))[-2:] == ["iter_0000002", "iter_0000003"]
    shutil.rmtree(save / "iter_0000003")
    resumed, _ = _run(overrides)
    assert [r["step"] for r in resumed] == [3.0]
    _close(resumed[0], records[2], 1e-6)


def test_colocated_tp2_actor_tp1_engine(ray_session: Any, root: Path, reference: list[dict[str, float]]) -> None:
    records, _ = _run(_recipe(root, "actor.tp=2"))
    for got, want in zip(records, reference):
        _close(got, want, 1e-4)
        assert got["rollout_logp_diff"] < 1e-4  # the engine holds the actor's weights after each sync
        # co-location: the optimizer state and grads really left during generation
        assert got["memory/actor_offloaded_gib"] > 0 and got["memory/rollout_host_rss_gib"] > 0


def test_async_dp2_runs_ahead_within_the_bound(ray_session: Any, root: Path, reference: list[dict[str, float]]) -> None:
    records, _ = _run(
        _recipe(
            root,
            "actor.dp=2",
            "actor.micro_batch_size=2",
            "rollout.colocate=false",
            "rollout.num_devices=1",
            "buffer.mode=async",
            "buffer.max_staleness=1",
            "train.steps=4",
        )
    )
    assert [r["staleness_max"] for r in records][0] == 0.0
    assert all(r["staleness_max"] <= 1 for r in records)
    assert sum(r["staleness_mean"] for r in records[1:]) > 0  # it did run ahead
    assert all("tis_weight_mean" in r for r in records)
    _close(records[0], reference[0], 1e-4)


def test_cli_runs_the_readme_recipe(
    ray_session: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_policy_cache: Path
) -> None:
    """``mindspeed-rl grpo --config examples/rl/grpo_tiny_cpu.yaml`` (the README's RL example), 2 steps.

    From a fresh working directory: ``actor.model: demo`` finds the demo policy in
    ``runs/rl-demo-model`` there (copied from the session's build: the build itself is the
    demo model's own test); the run writes its metrics, TensorBoard events, the reward
    curve and the final policy as a Hugging Face directory that transformers loads, whose
    weights moved away from the starting policy's; the step-2 held-out evaluation equals an
    independent scoring of that exported policy.
    """
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.cli import main

    recipe = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_tiny_cpu.yaml"
    import shutil

    shutil.copytree(demo_policy_cache, tmp_path / "runs" / "rl-demo-model")
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "grpo",
                "--config",
                str(recipe),
                "train.steps=2",
                "train.eval_interval=2",
                "train.eval_temperature=0",  # greedy: comparable with the demo model's own scorer below
                "train.eval_n=1",
                "checkpoint.save_hf=runs/policy",
            ]
        )
        == 0
    )
    logs = tmp_path / "runs" / "grpo-tiny-cpu"
    lines = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    # Step 0: the starting policy's held-out evaluation, before any update; then one line per step.
    assert [r["step"] for r in lines] == [0, 1, 2] and set(lines[0]) == {
        "step",
        "eval/reward_mean",
        "eval/response_length",
        "eval/reward/math",
    }
    lines = lines[1:]
    assert all(0 <= r["reward_mean"] <= 1 for r in lines)
    assert (logs / "reward.png").stat().st_size > 0 and any((logs / "tensorboard").iterdir())
    assert (logs / "report.txt").stat().st_size > 0  # the driver's full log
    start = AutoModelForCausalLM.from_pretrained(
        tmp_path
        / "runs"
        / "rl-demo-model"
        / next(p.name for p in (tmp_path / "runs" / "rl-demo-model").iterdir() if (p / "config.json").is_file())
    )
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "policy")
    moved = [name for name, p in trained.state_dict().items() if not torch.equal(p, start.state_dict()[name])]
    assert moved and set(trained.state_dict()) == set(start.state_dict())
    # The step-2 evaluation (greedy, held-out) equals the demo model's own scorer on the exported policy.
    from transformers import AutoTokenizer

    from mindspeed_llm.inference import InferenceEngine
    from mindspeed_rl.data import load_prompts
    from mindspeed_rl.demo.model import evaluate_accuracy

    engine = InferenceEngine.from_pretrained(tmp_path / "runs" / "policy", max_batch_size=64)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "runs" / "policy")
    want = evaluate_accuracy(engine, tokenizer, load_prompts("demo-test"), max_new_tokens=5)
    assert "eval/reward_mean" not in lines[0] and lines[1]["eval/reward_mean"] == pytest.approx(want, abs=1e-9)
