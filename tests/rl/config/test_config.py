"""GRPO recipes: loading with overrides, and every check naming the key and the fix."""

from __future__ import annotations

import importlib.util

import pytest

from mindspeed.config import ConfigError, to_dict
from mindspeed_rl.config.grpo import SECTIONS, GRPOConfig, load_grpo_config

RECIPE = """
actor: {model: MODEL, tokenizer: demo, tp: 1, dp: 2, lr: 1.0e-5, micro_batch_size: 2}
rollout: {n: 4, max_new_tokens: 64, temperature: 0.9}
algorithm: {loss: dapo, advantage: grpo_no_std, overlong_buffer: 16, dynamic_sampling: true}
reward: {verifiers: [math, format], weights: [1.0, 0.1], options: {format: {preset: gsm8k}}}
data: {path: demo, eval_path: demo-test, prompt_format: chat}
train: {steps: 20, global_batch: 8, eval_interval: 5}
"""


@pytest.fixture
def recipe(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    path = tmp_path / "grpo.yaml"
    path.write_text(RECIPE.replace("MODEL", str(model)))
    return path, model


def test_recipe_loads_overrides_and_checks(recipe) -> None:
    path, model = recipe
    config = load_grpo_config(path, ["rollout.n=8", "algorithm.clip_eps_high=0.3"])
    config.check(num_devices=2)
    assert set(to_dict(config)) == set(SECTIONS)
    assert config.rollout.n == 8 and config.actor.lr == 1e-5 and config.rows_per_step() == 64
    loss = config.algorithm.loss_config()
    # dapo's defaults, with the one setting the recipe overrides
    assert (loss.clip_eps_low, loss.clip_eps_high, loss.loss_agg_mode, loss.kl_coef) == (0.2, 0.3, "token-mean", 0.0)
    assert not config.needs_reference() and config.actor_world_size() == 2
    assert config.buffer.staleness() == 0
    ppo = load_grpo_config(path, ["algorithm.loss=ppo_clip", "algorithm.kl_estimator=k1"])
    assert ppo.needs_reference() and ppo.algorithm.loss_config().kl_estimator == "k1"
    ppo.check()


def test_load_errors_suggest_the_key(recipe) -> None:
    path, _ = recipe
    with pytest.raises(ConfigError, match="did you mean 'rollout.n'"):
        load_grpo_config(path, ["rollout.nn=3"])
    with pytest.raises(ConfigError, match="buffer.mode: 'later' is not one of"):
        load_grpo_config(path, ["buffer.mode=later"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_grpo_config(path.with_name("missing.yaml"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.model=null"], "actor.model is required"),
        (["actor.model=/no/such/dir"], "actor.model='/no/such/dir' does not exist"),
        (["actor.tokenizer=/no/tok"], "actor.tokenizer"),
        (["rollout.n=1"], "rollout.n=1: group-relative advantages"),
        (["rollout.temperature=0"], "rollout.temperature=0.0 must be positive"),
        (["rollout.top_p=1.5"], "rollout.top_p"),
        (["actor.tp=0"], "actor.tp=0 must be at least 1"),
        (["actor.min_lr=1"], "actor.min_lr <= actor.lr"),
        (["actor.lr_warmup_steps=20"], "actor.lr_warmup_steps=20"),
        (["actor.mini_batch_size=3"], "not divisible by actor.mini_batch_size=3"),
        (["actor.dp=3"], "does not split over actor.dp=3"),
        (["actor.micro_batch_size=3"], "not divisible by actor.micro_batch_size=3"),
        (["actor.max_tokens_per_micro_batch=100"], "below the longest sequence"),
        (["actor.pp=2", "actor.share_prompt=true"], "actor.share_prompt=true needs actor.pp=1"),
        (["actor.compile=true", "actor.tp=2"], "actor.compile=True is proven for a full-weight text policy"),
        (["actor.max_tokens_per_micro_batch=100000"], "not supported by the actor yet"),
        (["rollout.stop=[END]"], "stop strings are not supported"),
        (["rollout.max_turns=3"], "are for multi-turn rollouts: set rollout.tools"),
        (["rollout.tools=[abacus]"], "rollout.tools: unknown tool(s) ['abacus']; known: calculator, python"),
        (["rollout.tools=[calculator]", "rollout.max_turns=0"], "rollout.max_turns=0 must be at least 1"),
        (["rollout.tools=[calculator]", "rollout.max_parallel=0"], "rollout.max_parallel=0 must be at least 1"),
        (["rollout.tools=[calculator]", "rollout.tool_timeout_s=0"], "rollout.tool_timeout_s=0.0 must be positive"),
        (["rollout.tools=[calculator]", "rollout.tool_options={python: {}}"], "which are not among the tools"),
        (
            ["rollout.tools=[python]", "rollout.tool_options={python: {speed: 1}}"],
            "rollout.tool_options: tool 'python'",
        ),
        (["rollout.tools=[calculator]", "rollout.max_response_length=32"], "is below rollout.max_new_tokens=64"),
        (["rollout.tools=[calculator]", "data.prompt_format=plain"], "rollout.tools needs data.prompt_format=chat"),
        (["rollout.tp=4"], "rollout.tp=4 must divide the actor's 2 devices"),
        (["rollout.num_devices=2"], "rollout.num_devices is for a separated rollout pool"),
        (["rollout.colocate=false"], "needs rollout.num_devices"),
        (["rollout.colocate=false", "rollout.num_devices=3", "rollout.tp=2"], "not a multiple of rollout.tp=2"),
        (["ray.pool_resources={trainer: {a: 1}}"], "ray.pool_resources: unknown pool 'trainer'; use actor, rollout"),
        (["ray.pool_resources={actor: {a: 0}}"], "ray.pool_resources.actor={'a': 0}: give custom resource names"),
        (["ray.pool_resources={actor: {CPU: 2}}"], "ray.pool_resources.actor names CPU: devices and CPUs come"),
        (["ray.pool_resources={rollout: {b: 1}}"], "ray.pool_resources.rollout: this recipe has no separate rollout"),
        (["algorithm.advantage=remax"], "algorithm.advantage='remax'; use one of"),
        (["algorithm.loss=ppo"], "algorithm.loss='ppo'; use one of"),
        (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward needs a token-level advantage"),
        (
            ["algorithm.advantage=reinforce_plus_plus", "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.01"],
            "counts the KL twice (in the reward and in the loss); set algorithm.kl_coef=0",
        ),
        (
            [
                "algorithm.advantage=reinforce_plus_plus",
                "algorithm.use_kl_in_reward=true",
                "algorithm.kl_in_reward_estimator=k4",
            ],
            "algorithm.kl_in_reward_estimator='k4'; use one of",
        ),
        (["algorithm.gamma=0"], "algorithm.gamma=0.0 must be in (0, 1]"),
        (["algorithm.norm_length=0"], "algorithm.norm_length=0 must be a positive"),
        (["algorithm.clip_eps_low=1.5"], "algorithm: clip_eps_low=1.5"),
        (["algorithm.loss_agg_mode=mean"], "algorithm: loss_agg_mode='mean'"),
        (["algorithm.kl_estimator=k4"], "unknown KL estimator 'k4'"),
        (["algorithm.tis_cap=0.5"], "tis_cap=0.5 must be at least 1"),
        (["algorithm.overlong_buffer=100"], "algorithm.overlong_buffer=100 must be in (0, rollout.max_new_tokens=64]"),
        (["reference.model=/x"], "reference.model is set but the KL coefficient is 0"),
        (["algorithm.kl_coef=0.1", "reference.model=/no/ref"], "reference.model='/no/ref' does not exist"),
        (["buffer.max_staleness=1"], "buffer.mode=sync is on-policy"),
        (["buffer.mode=async", "buffer.max_staleness=0"], "set buffer.max_staleness >= 1"),
        (["buffer.mode=async"], "needs the rollout on its own devices"),
        (["reward.verifiers=[]"], "no reward"),
        (["reward.weights=[1.0]"], "reward.weights has 1 entries for 2 reward.verifiers"),
        (["reward.verifiers=[math, format, lean]", "reward.weights=null"], "unknown reward verifier 'lean'"),
        (["reward.options={format: {preset: xml}}"], "unknown format preset 'xml'"),
        (["reward.options={math: {tolerance: 1}}"], "reward verifier 'math'"),
        (["reward.model=/no/rm"], "reward.model='/no/rm' is not a Hugging Face model directory"),
        (["data.path=/no/data.jsonl"], "data.path: data file '/no/data.jsonl' does not exist"),
        (["data.map_keys={question: q}"], "data.map_keys: unknown key(s) question"),
        (["data.prompt_format=plain", "data.prompt_template=Q"], "placeholder"),
        (["data.eval_path=null"], "train.eval_interval needs data.eval_path"),
        (["train.global_batch=0"], "train.global_batch=0 must be at least 1"),
        (["train.eval_n=8"], "repeats the same response; set train.eval_temperature > 0"),
        (["train.eval_temperature=-1"], "train.eval_temperature=-1.0 must be >= 0"),
        (["checkpoint.interval=0"], "checkpoint.interval=0 must be at least 1 (or unset)"),
        # PPO's keys in a GRPO recipe: refused, not ignored (grpo has no critic and a fixed KL in the reward).
        (["algorithm.advantage=gae"], "algorithm.advantage=gae needs a critic, which mindspeed-rl grpo does not train"),
        (["algorithm.lam=0.95"], "algorithm.lam=0.95 is GAE's (PPO with a critic) and unused by grpo; remove it"),
        (["algorithm.lam=2"], "algorithm.lam=2.0 must be in [0, 1]"),
        (["algorithm.kl_ctrl.type=adaptive"], "grpo's KL-in-reward coefficient (algorithm.kl_ctrl.kl_coef) is fixed"),
        (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type='pid'; use one of fixed, adaptive"),
    ],
)
def test_bad_recipes_name_key_and_fix(recipe, overrides: list[str], message: str) -> None:
    path, _ = recipe
    config = load_grpo_config(path, overrides)
    with pytest.raises(ConfigError) as err:
        config.check()
    assert message in str(err.value)


def test_layout_against_devices_and_async(recipe, tmp_path) -> None:
    path, _ = recipe
    with pytest.raises(ConfigError, match="needs 2 devices .* but 1 are available"):
        load_grpo_config(path).check(num_devices=1)
    separated = load_grpo_config(path, ["rollout.colocate=false", "rollout.num_devices=1", "buffer.mode=async"])
    separated.check(num_devices=3)
    assert separated.buffer.staleness() == 1
    with pytest.raises(ConfigError, match=r"\+ rollout.num_devices = 1\) but 2"):
        separated.check(num_devices=2)
    assert GRPOConfig().log_dir() is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_needs_vllm(recipe) -> None:
    path, _ = recipe
    with pytest.raises(ConfigError, match=r"install mindspeed-rl\[vllm\]"):
        load_grpo_config(path, ["rollout.engine=vllm"]).check()


def test_kl_in_reward_replaces_the_loss_kl(recipe) -> None:
    """REINFORCE++ with the KL in the reward: the loss's default KL is off, a reference is built."""
    path, _ = recipe
    keys = [
        "algorithm.loss=ppo_clip",
        "algorithm.advantage=reinforce_plus_plus_baseline",
        "algorithm.kl_ctrl.kl_coef=0.01",
    ]
    plain = load_grpo_config(path, keys)
    assert plain.algorithm.loss_config().kl_coef == 0.001  # ppo_clip's default: the KL in the loss
    folded = load_grpo_config(path, [*keys, "algorithm.use_kl_in_reward=true"])
    folded.check()
    assert folded.algorithm.loss_config().kl_coef == 0.0 and folded.needs_reference()
    off = load_grpo_config(path, [*keys, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0"])
    assert not off.needs_reference()
    # The old spelling of the coefficient still works in a grpo recipe (moved to kl_ctrl.kl_coef).
    old = load_grpo_config(path, [*keys[:2], "algorithm.use_kl_in_reward=true", "algorithm.kl_in_reward_coef=0"])
    assert old.algorithm.kl_ctrl.kl_coef == 0 and not old.needs_reference()
    from mindspeed_rl.models.actor_settings import actor_settings

    # Dr. GRPO's constant: rollout.max_new_tokens unless algorithm.norm_length says otherwise.
    assert actor_settings(plain).loss_config.norm_length == 64
    assert actor_settings(load_grpo_config(path, ["algorithm.norm_length=40"])).loss_config.norm_length == 40


def test_rollout_compile_reaches_the_builtin_engine(recipe, monkeypatch) -> None:
    from mindspeed_rl.workers import rollout_worker

    seen: list[dict] = []
    monkeypatch.setattr(rollout_worker, "build_rollout", lambda name, model_dir, **kwargs: seen.append(kwargs))
    path, model = recipe
    for overrides in ([], ["rollout.compile=true"]):
        rollout_worker.build_engine(load_grpo_config(path, overrides), str(model))
    assert "compile" not in seen[0] and seen[1]["compile"] is True
    with pytest.raises(ConfigError, match="rollout.compile=true compiles the builtin engine"):
        load_grpo_config(path, ["rollout.compile=true", "rollout.engine=vllm"]).rollout.check()
