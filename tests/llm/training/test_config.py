"""Recipes: strict keys with suggestions, cross-field checks naming key and fix, the CLI's exit status, the LR schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mindspeed.config import ConfigError
from mindspeed_llm.cli import main
from mindspeed_llm.training.config import PretrainConfig, load_pretrain_config
from mindspeed_llm.training.model import padded_vocab_size
from mindspeed_llm.training.optim import build_scheduler
from tests.llm.training.datasets import write_indexed_dataset


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_indexed_dataset(tmp_path_factory.mktemp("cfg") / "d", 40, seed=0)


def _config(prefix: str, *overrides: str) -> PretrainConfig:
    return load_pretrain_config(None, [f"data.prefixes=[{prefix}]", "model.vocab_size=128", *overrides])


def test_recipe_and_overrides(tmp_path: Path, prefix: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{num_layers: 4, hidden_size: 32}}\ndata: {{prefixes: [{prefix}], seq_length: 16}}\n"
        "train: {lr: 1e-3}\nfeatures: {optimization_level: 0}\n"
    )
    config = load_pretrain_config(recipe, ["train.lr=2e-3", "parallel.tp=2", "model.vocab_size=64"])
    assert (config.model.num_layers, config.model.hidden_size, config.data.seq_length) == (4, 32, 16)
    assert (config.train.lr, config.parallel.tp, config.features.optimization_level) == (2e-3, 2, 0)
    config.check(world_size=4)
    assert config.data_parallel_size(4) == 2 and config.global_batch_size(4) == 2 and config.num_microbatches(4) == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stpes=3", "did you mean 'train.steps'"),
        ("paralel.tp=2", "did you mean 'parallel'"),
        ("train.precision=fp8", "is not one of"),
        ("model.megatron={num_layer: 2}", "did you mean 'num_layers'"),
    ],
)
def test_unknown_keys_and_values_are_errors_with_a_suggestion(prefix: str, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config = _config(prefix, override)
        config.check(1)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.tp=2"], 3, "not divisible by parallel.tp x parallel.pp"),
        (["parallel.pp=2", "parallel.vpp=2"], 2, r"model.num_layers=2 is not divisible by parallel.pp x parallel.vpp"),
        (["train.micro_batch_size=2", "train.global_batch_size=6"], 2, "use a multiple of 4"),
        (
            ["parallel.pp=2", "parallel.vpp=1", "model.num_layers=4", "train.global_batch_size=3"],
            2,
            "microbatches per step .3. to be a multiple of parallel.pp=2",
        ),
        (["parallel.sequence_parallel=true"], 1, "needs parallel.tp > 1"),
        (
            ["model.num_attention_heads=6", "model.hidden_size=60", "parallel.tp=4"],
            4,
            "must be divisible by parallel.tp=4",
        ),
        (["data.prefixes=[]"], 1, "data.prefixes is empty"),
        (["data.prefixes=[/nonexistent/x]"], 1, "/nonexistent/x.bin and /nonexistent/x.idx not found"),
        (["data.weights=[0.5,0.5]"], 1, "2 entries for 1 data.prefixes"),
        (["data.split=0,1,0"], 1, "positive train weight"),
        (["model.vocab_size=null"], 1, "model.vocab_size is unset"),
        (["train.steps=5", "train.lr_warmup_steps=5"], 1, "must be below train.lr_decay_steps"),
        (["checkpoint.finetune=true"], 1, "checkpoint.finetune needs checkpoint.load"),
        (["parallel.cp=2", "data.seq_length=34"], 2, r"data.seq_length=34 must be divisible by 2 x parallel.cp = 4"),
        (["data.reset_attention_mask=true"], 1, "data.reset_attention_mask needs data.eod_token_id"),
        (
            ["data.reset_attention_mask=true", "data.eod_token_id=0"],
            1,
            "data.reset_attention_mask and data.reset_position_ids go together",
        ),
        (["parallel.ep=2"], 2, "needs an MoE model"),
        (["train.lr=-1e-3"], 1, r"train.lr=-0.001 must be positive; give a learning rate such as train.lr=3e-4"),
        (["train.lr=0"], 1, r"train.lr=0.0 must be positive"),
        (["train.min_lr=-1e-5"], 1, r"train.min_lr=-1e-05 must not be negative"),
        (["train.weight_decay=-0.1"], 1, r"train.weight_decay=-0.1 must not be negative"),
        (["train.adam_beta2=1.0"], 1, r"train.adam_beta2=1.0 must be in \[0, 1\)"),
        (["model.num_layers=4", "model.noop_layers=0,9"], 1, r"model.noop_layers \[9\] are not layers of num_layers=4"),
        (["model.noop_layers=0,1"], 1, "leave no real layer"),
        (["model.noop_layers=a"], 1, "not a list of layer indices"),
    ],
)
def test_inconsistent_values_name_the_key_and_the_fix(
    prefix: str, overrides: list[str], world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(prefix, *overrides).check(world)


def test_cli_reports_a_bad_recipe_in_one_line_without_starting_ranks(
    prefix: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["pretrain", f"data.prefixes=[{prefix}]", "model.vocab_size=128", "train.stpes=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mindspeed-llm: error: unknown config key 'train.stpes'")
    assert (
        main(
            ["pretrain", "--nproc-per-node", "3", f"data.prefixes=[{prefix}]", "model.vocab_size=128", "parallel.tp=2"]
        )
        == 2
    )
    assert "world size 3 is not divisible" in capsys.readouterr().err
    # torch would say "Invalid learning rate: -0.001" from deep inside the optimizer
    assert (
        main(["pretrain", f"data.prefixes=[{prefix}]", "model.vocab_size=128", "train.lr=-1e-3", "train.min_lr=-1e-2"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mindspeed-llm: error: train.lr=-0.001 must be positive; give a learning rate such as train.lr=3e-4"]


def test_print_config_round_trips(tmp_path: Path, prefix: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["pretrain", "--print-config", f"data.prefixes=[{prefix}]", "train.lr=5e-4"]) == 0
    recipe = tmp_path / "printed.yaml"
    recipe.write_text(capsys.readouterr().out)
    assert load_pretrain_config(recipe) == load_pretrain_config(None, [f"data.prefixes=[{prefix}]", "train.lr=5e-4"])


def test_model_section_passes_megatron_recompute_and_noop_layers_through(prefix: str) -> None:
    from mindspeed_llm.training.model import recipe_transformer_config

    def transformer(*overrides: str) -> object:
        config = _config(prefix, "model.num_layers=4", *overrides)
        return recipe_transformer_config(config, config.model.to_shape(128, 32))

    full = transformer(
        "model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=3"
    )
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "block", 3)
    selective = transformer("model.recompute_granularity=selective", "model.recompute_modules=[mlp,core_attn]")
    assert selective.recompute_modules == ["mlp", "core_attn"]
    assert transformer("train.deterministic=true").deterministic_mode
    noop = _config(prefix, "model.num_layers=6", "model.noop_layers=0,5", "parallel.pp=2")
    noop.check(2)
    assert noop.model.to_shape(128, 32).num_layers == 4  # the model has the real layers only


def test_vocab_padding_is_the_same_at_every_tensor_parallel_size() -> None:
    assert [padded_vocab_size(100, 128, tp) for tp in (1, 2, 4, 8)] == [128] * 4
    assert padded_vocab_size(1000, 128, 3) == 1152 and padded_vocab_size(128, 128, 1) == 128


class _Groups:
    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def test_train_section_gives_the_optimizer_and_scheduler_sections() -> None:
    from mindspeed_llm.training.sections import OptimizerConfig, SchedulerConfig

    t = load_pretrain_config(
        None,
        ["train.lr=1e-2", "train.min_lr=1e-4", "train.optimizer=sgd", "train.lr_decay_steps=7", "train.adam_eps=1e-6"],
    ).train
    assert t.optimizer_config() == OptimizerConfig(optimizer="sgd", lr=1e-2, min_lr=1e-4, adam_eps=1e-6)
    assert t.scheduler_config() == SchedulerConfig(lr=1e-2, min_lr=1e-4, lr_decay_steps=7)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_lr_schedule_warmup_then_decay(style: str) -> None:
    config = load_pretrain_config(
        None,
        [
            "train.steps=20",
            "train.lr=1e-2",
            "train.min_lr=1e-4",
            "train.lr_warmup_steps=4",
            "train.lr_warmup_init=1e-3",
            f"train.lr_decay_style={style}",
            "train.weight_decay=0.1",
        ],
    )
    optimizer = _Groups()
    scheduler = build_scheduler(config.train.scheduler_config(), optimizer, config.train.steps)
    seen = []
    for _ in range(25):
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)

    def expected(k: int) -> float:  # written from the definition, not from megatron's code
        if k <= 4:
            return 1e-3 + (1e-2 - 1e-3) * k / 4
        if k > 20:
            return 1e-4
        ratio = (k - 4) / 16
        coeff = 0.5 * (1 + math.cos(math.pi * ratio)) if style == "cosine" else 1 - ratio
        return 1e-4 + coeff * (1e-2 - 1e-4)

    assert seen == pytest.approx([expected(k) for k in range(25)], rel=1e-12)
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
    restored = build_scheduler(config.train.scheduler_config(), _Groups(), config.train.steps)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
