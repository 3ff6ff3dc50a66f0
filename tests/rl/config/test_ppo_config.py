"""PPO recipes: the ``critic`` section and ``algorithm.lam`` / ``algorithm.kl_ctrl``, each bad value one line."""

from __future__ import annotations

import logging

import pytest

from mindspeed.config import ConfigError, to_dict
from mindspeed_rl.algorithms import AdaptiveKLController
from mindspeed_rl.config.ppo import PPOConfig, load_ppo_config

RECIPE = """
actor: {model: MODEL, tokenizer: demo, lr: 1.0e-6}
rollout: {n: 1, max_new_tokens: 32}
algorithm: {lam: 0.95, gamma: 1.0, use_kl_in_reward: true, kl_ctrl: {type: adaptive, kl_coef: 0.02, target_kl: 0.05, horizon: 500}}
critic: {model: MODEL, cliprange_value: 0.2, lr: 1.0e-5, warmup_steps: 2}
train: {steps: 10, global_batch: 4}
"""


@pytest.fixture
def recipe(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    path = tmp_path / "ppo.yaml"
    path.write_text(RECIPE.replace("MODEL", str(model)))
    return path


def test_ppo_recipe_loads_and_checks(recipe) -> None:
    config = load_ppo_config(recipe, ["critic.value_loss=mse"])
    config.check(num_devices=1)  # rollout.n=1 is fine with a critic (its values are the baseline)
    assert "critic" in to_dict(config) and config.critic.cliprange_value == 0.2
    assert (config.algorithm.advantage, config.algorithm.lam) == ("gae", 0.95)
    controller = config.reward_kl_controller()
    assert isinstance(controller, AdaptiveKLController) and controller.value == 0.02
    assert (controller.target_kl, controller.horizon) == (0.05, 500)
    # kl_ctrl.kl_coef unset: verl's default 0.001.
    fixed = load_ppo_config(recipe, ["algorithm.kl_ctrl.type=fixed"])
    assert type(fixed.reward_kl_controller()).__name__ == "KLController"
    assert load_ppo_config(None).reward_kl_controller().value == 0.001
    assert config.needs_reference()
    assert not load_ppo_config(recipe, ["algorithm.kl_ctrl.kl_coef=0"]).needs_reference()
    defaults = PPOConfig()
    assert defaults.algorithm.advantage == "gae" and defaults.critic.cliprange_value == 0.5
    assert (defaults.algorithm.kl_ctrl.target_kl, defaults.algorithm.kl_ctrl.horizon) == (0.1, 10000)  # verl's


def test_kl_in_reward_coef_is_the_old_spelling_of_kl_ctrl_kl_coef(recipe, caplog) -> None:
    """One coefficient, one key (verl's algorithm.kl_ctrl.kl_coef); the old key still works, with one line."""
    with caplog.at_level(logging.WARNING, logger="mindspeed_rl.config.sections"):
        old = load_ppo_config(None, ["algorithm.kl_in_reward_coef=0.05"])
    lines = [r.getMessage() for r in caplog.records if r.name == "mindspeed_rl.config.sections"]
    assert lines == ["algorithm.kl_in_reward_coef is renamed algorithm.kl_ctrl.kl_coef (verl's key); using 0.05"]
    assert old.algorithm.kl_ctrl.kl_coef == 0.05 and old.algorithm.kl_in_reward_coef is None
    assert old.reward_kl_controller().value == 0.05
    folded = ["algorithm.use_kl_in_reward=true", "algorithm.kl_in_reward_coef=0"]
    assert not load_ppo_config(None, folded).needs_reference()  # it moved: 0 is off
    # The same value under both keys is one value; two different values are refused (one line, both keys).
    assert load_ppo_config(recipe, ["algorithm.kl_in_reward_coef=0.02"]).algorithm.kl_ctrl.kl_coef == 0.02
    with pytest.raises(ConfigError, match=r"kl_in_reward_coef=0.5 and algorithm.kl_ctrl.kl_coef=0.02 set one"):
        load_ppo_config(recipe, ["algorithm.kl_in_reward_coef=0.5"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.advantage=grpo", "rollout.n=4"],
            "PPO with a critic takes a critic-based advantage (gae); set algorithm.advantage=gae",
        ),
        (["algorithm.lam=-0.1"], "algorithm.lam=-0.1 must be in [0, 1]"),
        (["algorithm.kl_ctrl.type=pi"], "algorithm.kl_ctrl.type='pi'; use one of fixed, adaptive"),
        (["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef=-1.0 must be >= 0"),
        (["algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl=0.0 must be > 0"),
        (["algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon=0 >= 1"),
        (["critic.value_loss=huber"], "critic.value_loss='huber'; use one of clipped, mse"),
        (["critic.cliprange_value=0"], "critic.cliprange_value=0.0 must be > 0"),
        (["critic.loss_agg_mode=sum"], "critic.loss_agg_mode='sum'; use one of token-mean"),
        (["critic.loss_agg_mode=seq-mean-token-mean"], "reduces its loss by token-mean only"),
        (["critic.lr=0"], "critic.lr=0.0 must be positive"),
        (["critic.min_lr=1"], "need 0 <= critic.min_lr <= critic.lr"),
        (["critic.lr_warmup_steps=10"], "critic.lr_warmup_steps=10 must be in [0, train.steps=10)"),
        (["critic.clip_grad=-1"], "critic.clip_grad=-1.0 must be >= 0"),
        (["critic.ppo_epochs=0"], "critic.ppo_epochs=0 must be at least 1"),
        (["critic.warmup_steps=10"], "critic.warmup_steps=10 must be in [0, train.steps=10)"),
        (["critic.model=/no/rm"], "critic.model='/no/rm' does not exist"),
        (["critic.load=/no/ckpt"], "critic.load='/no/ckpt' holds no complete checkpoint; give an iter_*"),
    ],
)
def test_bad_ppo_keys_name_key_and_fix(recipe, overrides: list[str], message: str) -> None:
    config = load_ppo_config(recipe, overrides)
    with pytest.raises(ConfigError) as err:
        config.check()
    assert message in str(err.value) and "\n" not in str(err.value)
