"""The megatron policy-loss wiring against the algorithm computed directly, and GRPO end to end.

One spawned single-rank group:

- runs three actor updates over 5 sequences in microbatches of 2 (so a microbatch of 1): PPO-clip
  with token-mean aggregation, then with seq-mean-token-mean and a k3 KL penalty to a
  reference, then with dual clip and truncated importance sampling against rollout log-probs. Old log-probs are the actor's own shifted by noise, so the ratio is far from 1
  and clipping is active. The parent recomputes each update's loss with
  ``compute_policy_loss`` on the whole batch as ``[batch, len]`` tensors from the actor's
  log-probs before that update: equal losses prove the per-microbatch sums, counts and
  megatron's per-token-loss reduction add up to the algorithm's aggregation. The gradient
  norm megatron's optimizer reports must equal the norm of transformers' autograd gradient of
  that loss (the HF model holding the actor's weights of that moment): the gradient scaling
  by the step's total count is right, not only the reported number;
- runs ``train_grpo`` for two steps on the shipped arithmetic set with a tiny Llama (KL to a
  frozen reference on): every metric is finite and the weights the engine generates with are
  the actor's (the engine's sampled log-probs equal the actor's old log-probs of them). Its
  records go through the core's trackers (``logging.trackers=[jsonl, tensorboard]``):
  ``metrics.jsonl`` holds exactly the returned records (every key, floats bit for bit, as the
  trainer's own JSON lines did) and TensorBoard's event reader returns every numeric series of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [
    ([1, 5, 9], [20, 21, 7, 8]),
    ([3, 4], [30, 31]),
    ([8, 9, 10, 11], [40, 41, 42, 43, 44]),
    ([12], [13, 14, 15]),
    ([16, 17], [18]),
]
ADV = [1.0, -0.5, 0.7, -1.2, 0.3]
MODES = {
    "token": dict(loss_agg_mode="token-mean", kl_coef=0.0),
    "seq": dict(loss_agg_mode="seq-mean-token-mean", kl_coef=0.05, kl_estimator="k3"),
    "tis": dict(loss_agg_mode="token-mean", kl_coef=0.0, tis_cap=1.2, clip_ratio_c=3.0),
    # Dr. GRPO with a fixed length (algorithm.norm_length), not the batch's widest response (5).
    "norm": dict(loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.0, norm_length=9),
}
#: token-level estimators run end to end for two steps each (the first with the KL in the reward).
TOKEN_ESTIMATORS = {
    "reinforce_plus_plus": ["algorithm.use_kl_in_reward=true", "algorithm.kl_in_reward_coef=0.05"],
    "reinforce_plus_plus_baseline": ["algorithm.kl_coef=0", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
}


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_rl.algorithms import policy_loss_config
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.trainer import train_grpo
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=5e-3, micro_batch_size=2, clip_grad=0.0))
    width = max(len(r) for _, r in PAIRS)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for name, overrides in MODES.items():
        actor.settings.loss_config = policy_loss_config("ppo_clip", **overrides)
        now = _pad(actor.compute_logprobs(PAIRS), width)
        mask = _pad([torch.ones(len(r)) for _, r in PAIRS], width)
        old = (now + 0.4 * torch.randn(now.shape, generator=gen)) * mask
        ref = (now + 0.3 * torch.randn(now.shape, generator=gen)) * mask
        rollout = (old + 0.3 * torch.randn(now.shape, generator=gen)) * mask
        weights = {k: v.clone().numpy() for k, v in actor.hf_state().items()}
        metrics = actor.update(PAIRS, old, torch.tensor(ADV), ref, rollout)
        out[name] = {
            "now": now.numpy(),
            "old": old.numpy(),
            "ref": ref.numpy(),
            "rollout": rollout.numpy(),
            "mask": mask.numpy(),
            "metrics": metrics,
            "weights": weights,
        }
    config_keys = [
        f"actor.model={root}/hf",
        "actor.lr=1e-3",
        "actor.micro_batch_size=4",
        "data.path=demo",
        "data.prompt_format=plain",
        "rollout.n=4",
        "rollout.max_new_tokens=6",
        "rollout.max_prompt_length=64",
        "train.global_batch=2",
        "train.steps=2",
        "algorithm.kl_coef=0.01",
        "algorithm.overlong_buffer=2",
        "logging.progress=false",
        f"logging.dir={root}/logs",
    ]
    config = load_grpo_config(None, [*config_keys, "logging.trackers=[jsonl, tensorboard]"])
    import gc

    from mindspeed_rl.driver import trainer

    frozen: list[int] = []
    grpo_step = trainer.grpo_step
    # train_grpo exempts what it built from the cyclic collector while it runs, and lifts that at its end.
    trainer.grpo_step = lambda ctx: frozen.append(gc.get_freeze_count()) or grpo_step(ctx)
    try:
        out["e2e"] = train_grpo(config)
    finally:
        trainer.grpo_step = grpo_step
    out["frozen"] = [*frozen, gc.get_freeze_count()]
    # REINFORCE++ (both): the trainer hands the actor [rows, width] advantages; one short run each.
    seen: dict[str, list[torch.Tensor]] = {}
    compute = trainer.compute_token_advantages

    def spy(name: str, *args: Any) -> torch.Tensor:
        adv = compute(name, *args)
        seen.setdefault(name, []).append(adv)
        return adv

    # The tiny random policy earns the same reward everywhere (no signal); alternate it by row.
    collect = trainer.collect_rollout

    def alternating(ctx: Any) -> Any:
        batch = collect(ctx)
        batch.rewards = torch.arange(len(batch.rewards)).remainder(2).float()
        return batch

    trainer.compute_token_advantages, trainer.collect_rollout = spy, alternating
    try:
        for name, keys in TOKEN_ESTIMATORS.items():
            base = [k for k in config_keys if not k.startswith(("algorithm.", "logging.dir", "train.steps"))]
            cfg = load_grpo_config(None, [*base, "train.steps=2", f"algorithm.advantage={name}", *keys])
            out[name] = {"records": train_grpo(cfg), "advantages": [a.numpy() for a in seen.get(name, [])]}
    finally:
        trainer.compute_token_advantages, trainer.collect_rollout = compute, collect
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("grpo")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    out = run_distributed(_group, 1, str(root), timeout=400)[0]
    out["root"] = root
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_update_loss_equals_direct_computation(run: dict[str, Any], mode: str) -> None:
    from mindspeed_rl.algorithms import PolicyLossInputs, compute_policy_loss, policy_loss_config

    got = run[mode]
    t = {k: torch.from_numpy(got[k]) for k in ("now", "old", "ref", "rollout", "mask")}
    inputs = PolicyLossInputs(
        logp=t["now"],
        old_logp=t["old"],
        advantages=torch.tensor(ADV),
        mask=t["mask"],
        ref_logp=t["ref"],
        rollout_logp=t["rollout"],
    )
    want = compute_policy_loss("ppo_clip", inputs, policy_loss_config("ppo_clip", **MODES[mode]))
    metrics = got["metrics"]
    assert want.metrics["pg_clipfrac"] > 0  # the clip is exercised
    assert math.isclose(metrics["loss"], float(want.loss), rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(metrics["pg_loss"], float(want.metrics["pg_loss"]), rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac"], float(want.metrics["pg_clipfrac"]), abs_tol=1e-6)
    if MODES[mode].get("tis_cap"):
        assert want.metrics["tis_clipfrac"] > 0
        assert math.isclose(metrics["tis_clipfrac"], float(want.metrics["tis_clipfrac"]), abs_tol=1e-6)
    if MODES[mode]["kl_coef"]:
        assert math.isclose(metrics["kl_loss"], float(want.metrics["kl_loss"]), rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("mode", list(MODES))
def test_update_gradient_equals_autograd(run: dict[str, Any], mode: str) -> None:
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.algorithms import PolicyLossInputs, compute_policy_loss, policy_loss_config

    got = run[mode]
    model = AutoModelForCausalLM.from_pretrained(run["root"] / "hf", dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in got["weights"].items()})
    width = got["now"].shape[1]
    rows = []
    for prompt, response in PAIRS:
        logits = model(torch.tensor([[*prompt, *response]])).logits[0]
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(logp, (0, width - len(response))))
    t = {k: torch.from_numpy(got[k]) for k in ("old", "ref", "rollout", "mask")}
    inputs = PolicyLossInputs(
        logp=torch.stack(rows),
        old_logp=t["old"],
        advantages=torch.tensor(ADV),
        mask=t["mask"],
        ref_logp=t["ref"],
        rollout_logp=t["rollout"],
    )
    loss = compute_policy_loss("ppo_clip", inputs, policy_loss_config("ppo_clip", **MODES[mode])).loss
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    assert math.isclose(got["metrics"]["grad_norm"], float(norm), rel_tol=1e-4)


def test_grpo_runs_end_to_end(run: dict[str, Any]) -> None:
    records = run["e2e"]
    assert len(records) == 2
    for record in records:
        for key in (
            "reward/overlong",
            "reward_mean",
            "reward_std",
            "response_length",
            "loss",
            "kl_loss",
            "pg_clipfrac",
            "rollout_tps",
            "update_tps",
            "e2e_tps",
            "time/rollout",
            "time/update",
            "time/weight_sync",
        ):
            assert math.isfinite(record[key]), (key, record)
        # The engine sampled with the actor's weights (synced after step 1): same log-probs.
        assert record["rollout_logp_diff"] < 1e-4, record
    assert records[-1]["policy_version"] == 2
    lines = (run["root"] / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1.0, 2.0]
    # The core's JSONL tracker writes what the trainer's json.dumps lines held: every key, floats exact.
    assert [json.loads(line) for line in lines] == records
    # ... and TensorBoard gets the same series (float32), through its own event reader.
    from tests.core.metrics.readers import jsonl_series, tensorboard_series

    want = jsonl_series(run["root"] / "logs" / "metrics.jsonl")
    got = tensorboard_series(run["root"] / "logs" / "tensorboard")
    assert {"reward_mean", "loss", "time/update"} <= set(want) and set(got) == set(want), sorted(set(got) ^ set(want))
    for key, points in want.items():
        assert got[key] == [(step, float(torch.tensor(value, dtype=torch.float32))) for step, value in points], key
    assert min(run["frozen"][:2]) > 10_000 and run["frozen"][2] == 0, run["frozen"]


class _Out:
    def __init__(self, prompt: list[int], seed: int) -> None:
        # A reward-relevant token that depends on the request's seed: groups of 2 agree or not.
        self.prompt_token_ids, self.token_ids, self.logprobs = prompt, [seed % 3, 7], [-0.5, -0.25]


class _Engine:
    def generate(self, prompts: list[list[int]], params: list[Any]) -> list[_Out]:
        return [_Out(p, q.seed) for p, q in zip(prompts, params)]


class _Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [len(text) % 50 + 3, 1]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def test_dynamic_sampling_keeps_only_informative_groups() -> None:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.data import PromptFormat, PromptRecord, PromptSampler
    from mindspeed_rl.driver.trainer import GRPOContext, collect_rollout
    from mindspeed_rl.rewards import WeightedReward

    config = load_grpo_config(
        None,
        [
            "rollout.n=2",
            "train.global_batch=3",
            "algorithm.dynamic_sampling=true",
            "algorithm.dynamic_sampling_max_rounds=20",
        ],
    )
    records = [PromptRecord(f"question {i}" + "x" * i, str(i), i) for i in range(12)]
    reward = WeightedReward({"zero": lambda prompt, response, ref: float(response.startswith("0"))})
    ctx = GRPOContext(
        config,
        None,
        _Engine(),
        _Tokenizer(),
        reward,
        records,
        PromptSampler(12, 3, seed=0),  # type: ignore[arg-type]
        PromptFormat(style="plain"),
    )
    batch = collect_rollout(ctx)
    assert len(batch.pairs) == 6 and batch.rewards.shape == (6,)
    groups = batch.rewards.view(3, 2)
    assert bool((groups[:, 0] != groups[:, 1]).all())  # every kept group carries a signal
    # Rows stay aligned: each reward is the verifier's verdict on that row's own response.
    assert [float(response[0] == 0) for _, response in batch.pairs] == batch.rewards.tolist()
    assert batch.metrics["dynamic_sampling/rounds"] >= 1
    assert batch.metrics["dynamic_sampling/dropped_groups"] > 0


@pytest.mark.parametrize("name", list(TOKEN_ESTIMATORS))
def test_reinforce_plus_plus_takes_steps(run: dict[str, Any], name: str) -> None:
    """A GRPO run with each REINFORCE++ estimator updates the policy with whitened per-token advantages."""
    got = run[name]
    records, advantages = got["records"], got["advantages"]
    assert len(records) == 2 and len(advantages) == 2
    for record in records:
        for key in ("reward_mean", "loss", "pg_loss", "grad_norm"):
            assert math.isfinite(record[key]), (key, record)
        assert record["rollout_logp_diff"] < 1e-4, record  # the update changed the weights the engine uses
    assert records[-1]["policy_version"] == 2
    for adv in advantages:
        assert adv.ndim == 2 and adv.shape[0] == 8  # 2 prompts x 4 samples, one value per token
    if name == "reinforce_plus_plus":  # KL in the reward, none in the loss
        assert "kl_loss" in records[0] and records[0]["kl_in_reward"] == 0.0  # the policy is the reference
        # One update later it is not (k1, verl's default in the reward, may be negative; k3 is > 0).
        assert records[1]["kl_in_reward"] != 0 and records[1]["kl_loss"] > 0
