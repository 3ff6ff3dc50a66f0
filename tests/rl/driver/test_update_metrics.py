"""A step's record from its several actor and critic updates: a MoE model's aux losses are averaged as the others.

:func:`ppo_train_on_batch` runs as ``mindspeed-rl ppo`` runs it (GRPO's ``step_record`` makes the
actor's part), with stand-ins for the actor and the critic whose updates report other numbers each
call: 2 mini-batches x 2 epochs = 4 updates of each. The record's ``load_balancing_loss`` /
``z_loss`` (the actor's) and ``critic/load_balancing_loss`` / ``critic/z_loss`` are the means of
the four updates' values, as ``loss`` and ``critic/vf_loss`` are; a dense model's updates (no
aux losses) put no such key in the record. The numbers of a real MoE actor's and critic's updates
are proven in tests/rl/models/test_actor_features.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed_rl.config.ppo import load_ppo_config
from mindspeed_rl.driver.ppo_trainer import PPOContext, ppo_train_on_batch
from mindspeed_rl.driver.trainer import RolloutBatch

LENGTHS = [3, 2, 4, 1]


class StandIn:
    """An actor or critic whose ``update`` reports ``base + k`` for its k-th call (and aux losses when MoE)."""

    def __init__(self, moe: bool) -> None:
        self.moe, self.calls, self.version = moe, 0, 0

    def compute_logprobs(self, pairs: list[Any]) -> list[torch.Tensor]:
        return [torch.full((len(r),), -1.0) for _, r in pairs]

    compute_values = compute_logprobs

    def update(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        k, self.calls = self.calls, self.calls + 1
        out = {"loss": 1.0 + k, "vf_loss": 2.0 + k, "grad_norm": 0.5 * k, "lr": 1e-3, "skipped": 0.0}
        out["update_tokens"] = 10.0
        if self.moe:
            out.update(load_balancing_loss=1.0 + 0.1 * k, z_loss=3.0 - 0.2 * k)
        return out


def _step(moe: bool) -> dict[str, float]:
    overrides = [
        "rollout.n=2",
        "train.global_batch=2",
        "actor.mini_batch_size=1",
        "actor.ppo_epochs=2",
        "critic.ppo_epochs=2",
        "critic.warmup_steps=0",
    ]
    config = load_ppo_config(None, overrides)
    ctx = PPOContext(config, StandIn(moe), None, None, None, [], None, None, critic=StandIn(moe))
    pairs = [([5, 6], [9] * n) for n in LENGTHS]
    batch = RolloutBatch(
        pairs, ["p"] * 4, [None] * 4, [torch.zeros(n) for n in LENGTHS], torch.tensor([1.0, 0.0, 0.5, -1.0]), {}
    )
    record = ppo_train_on_batch(ctx, batch)
    assert ctx.actor.calls == ctx.critic.calls == 4  # 2 mini-batches x 2 epochs each
    return record


def test_moe_aux_losses_are_averaged_over_the_step_updates() -> None:
    record = _step(moe=True)
    mean = sum(range(4)) / 4
    assert record["loss"] == pytest.approx(1.0 + mean) and record["critic/vf_loss"] == pytest.approx(2.0 + mean)
    for prefix in ("", "critic/"):
        assert record[f"{prefix}load_balancing_loss"] == pytest.approx(1.0 + 0.1 * mean), prefix
        assert record[f"{prefix}z_loss"] == pytest.approx(3.0 - 0.2 * mean), prefix
    assert record["critic/lr"] == 1e-3 and record["critic/skipped_updates"] == 0.0
    assert "critic/update_tokens" not in record and "critic/skipped" not in record


def test_a_dense_model_logs_no_aux_loss() -> None:
    record = _step(moe=False)
    assert not [key for key in record if key.endswith(("load_balancing_loss", "z_loss"))], sorted(record)
    assert record["critic/grad_norm"] == pytest.approx(0.5 * 1.5)
