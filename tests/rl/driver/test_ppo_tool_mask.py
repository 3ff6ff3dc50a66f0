"""PPO's step on a multi-turn batch: tool-response tokens carry no reward, no KL, no advantage and no value loss.

:func:`ppo_train_on_batch` runs as ``mindspeed-rl ppo`` runs it, with recording stand-ins for the
actor, the reference and the critic (the real critic's masked value loss and the actor's masked
gradient are proven in tests/rl/driver/test_tool_rollout.py). The semantics (docs/rl/tools.md):
GAE over a response with tool tokens is GAE over its generated tokens alone, the tool tokens
removed (the outcome reward at the last generated token, ``V`` and ``A`` carried across a tool
response, the KL penalty on generated tokens only), the advantages whitened over the batch's
generated tokens; the tool tokens get advantage 0, return 0, and the critic receives the mask
(value-loss weight 0 there). The expected numbers are computed by hand on the compressed rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed_rl.config.ppo import load_ppo_config
from mindspeed_rl.driver.ppo_trainer import PPOContext, ppo_train_on_batch
from mindspeed_rl.driver.trainer import RolloutBatch

GAMMA, LAM = 0.9, 0.8
#: Per row: 1 generated, 0 tool response (a row ends with generated tokens, or with a tool
#: response cut by the length limit: row 3).
MASKS = [[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 1, 0, 0]]
REWARDS = [1.0, 0.0, 0.5, -1.0]


class Recorder:
    """An actor, reference or critic that returns fixed tensors and records what it is given."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows, self.calls, self.version = rows, [], 0

    def compute_logprobs(self, pairs: list[Any]) -> list[torch.Tensor]:
        return [r.clone() for r in self.rows]

    compute_values = compute_logprobs

    def update(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.calls.append((args, kwargs))
        return {"loss": 0.0, "vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0, "grad_norm": 0.0, "lr": 1.0}


def _rows(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(len(m), generator=g) for m in MASKS]


def _step(kl_in_reward: bool, tool_noise: float) -> tuple[dict[str, Any], Recorder, Recorder]:
    """One PPO step; ``tool_noise`` is added to the values and log-probs at the tool tokens."""
    overrides = [
        "rollout.n=2",
        "train.global_batch=2",
        f"algorithm.gamma={GAMMA}",
        f"algorithm.lam={LAM}",
        "critic.warmup_steps=0",
    ]
    if kl_in_reward:
        overrides += ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1"]
    config = load_ppo_config(None, overrides)
    tools = [1 - torch.tensor(m, dtype=torch.float32) for m in MASKS]
    values = [v + tool_noise * t for v, t in zip(_rows(1), tools)]
    policy = [p - 1.0 + tool_noise * t for p, t in zip(_rows(2, 0.3), tools)]
    reference = [p - 1.0 for p in _rows(3, 0.3)]
    actor, critic = Recorder(policy), Recorder(values)
    ctx = PPOContext(
        config,
        actor,
        None,
        None,
        None,
        [],
        None,
        None,
        reference=Recorder(reference) if kl_in_reward else None,
        critic=critic,
        kl_ctrl=config.reward_kl_controller(),
    )
    pairs = [([5, 6, 7], [9] * len(m)) for m in MASKS]
    batch = RolloutBatch(
        pairs,
        ["p"] * 4,
        [None] * 4,
        [torch.zeros(len(m)) for m in MASKS],
        torch.tensor(REWARDS),
        {},
        {},
        [torch.tensor(m, dtype=torch.float32) for m in MASKS],
    )
    record = ppo_train_on_batch(ctx, batch)
    return record, actor, critic


def _by_hand(kl_in_reward: bool) -> tuple[list[list[float]], list[list[float]]]:
    """Whitened advantages and returns of the generated tokens of each row, the tool tokens removed."""
    values, policy, reference = _rows(1), _rows(2, 0.3), _rows(3, 0.3)
    raw, returns = [], []
    for i, m in enumerate(MASKS):
        keep = [t for t, x in enumerate(m) if x]
        v = [float(values[i][t]) for t in keep]
        r = [-0.1 * float(policy[i][t] - reference[i][t]) if kl_in_reward else 0.0 for t in keep]  # k1 KL
        r[-1] += REWARDS[i]
        a, run = [0.0] * len(keep), 0.0
        for t in reversed(range(len(keep))):
            run = r[t] + GAMMA * (v[t + 1] if t + 1 < len(keep) else 0.0) - v[t] + GAMMA * LAM * run
            a[t] = run
        raw.append(a)
        returns.append([x + y for x, y in zip(a, v)])
    flat = torch.tensor([x for row in raw for x in row], dtype=torch.float64)
    mean, var = flat.mean(), flat.var(unbiased=True)
    whitened = [[float((x - mean) / torch.sqrt(var + 1e-8)) for x in row] for row in raw]
    return whitened, returns


@pytest.mark.parametrize("kl_in_reward", [False, True], ids=["outcome", "kl_in_reward"])
def test_gae_over_a_multi_turn_batch_is_gae_over_the_generated_tokens(kl_in_reward: bool) -> None:
    record, actor, critic = _step(kl_in_reward, tool_noise=0.0)
    (pairs, old, advantages, ref, rollout), kwargs = actor.calls[0]
    width = advantages.shape[1]
    mask = torch.zeros(len(MASKS), width)
    for i, m in enumerate(MASKS):
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    torch.testing.assert_close(kwargs["loss_mask"], mask, rtol=0, atol=0)  # the actor's loss mask
    (_, c_values, c_returns, c_mask), _ = critic.calls[0]
    torch.testing.assert_close(c_mask, mask, rtol=0, atol=0)  # the critic's value-loss mask
    whitened, returns = _by_hand(kl_in_reward)
    for i, m in enumerate(MASKS):
        keep = [t for t, x in enumerate(m) if x]
        gone = [t for t in range(width) if t not in keep]
        torch.testing.assert_close(
            advantages[i, keep].double(), torch.tensor(whitened[i], dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            c_returns[i, keep].double(), torch.tensor(returns[i], dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        assert torch.equal(advantages[i, gone], torch.zeros(len(gone))), "no advantage on tool tokens or padding"
        assert torch.equal(c_returns[i, gone], torch.zeros(len(gone))), "no return on tool tokens or padding"
    assert record["critic/advantages_mean"] == pytest.approx(0.0, abs=1e-6)  # whitened over generated tokens


@pytest.mark.parametrize("kl_in_reward", [False, True], ids=["outcome", "kl_in_reward"])
def test_tool_tokens_values_and_logprobs_change_nothing(kl_in_reward: bool) -> None:
    """Values and log-probs at the tool tokens (the critic's and the policy's outputs there) do not enter
    the advantages or the returns: their gradient through GAE is zero."""
    _, actor, critic = _step(kl_in_reward, tool_noise=0.0)
    _, noisy_actor, noisy_critic = _step(kl_in_reward, tool_noise=37.0)
    assert torch.equal(actor.calls[0][0][2], noisy_actor.calls[0][0][2])  # advantages
    assert torch.equal(critic.calls[0][0][2], noisy_critic.calls[0][0][2])  # returns
