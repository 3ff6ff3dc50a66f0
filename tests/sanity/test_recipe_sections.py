"""The recipe sections every suite composes are the core's classes, extended by subclassing, never copied.

One ``checkpoint``, ``train`` and ``logging`` section in the core (issue 25, item 2), and one ``eval`` and
``lora`` section of the suites that have them: each suite's is the core class or a subclass of it, each checks its own values next to its fields, and a recipe's keys keep
the order and the messages users know. The ``data`` sections are three different sections (megatron
indexed text, mllm_format media, RL prompts) under three names.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from mindspeed.checkpointing.config import CheckpointConfig
from mindspeed.config import ConfigError, from_dict, recipe_section
from mindspeed.lora_config import LoraConfig
from mindspeed.metrics.config import LoggingConfig
from mindspeed.training_config import EvalConfig, OptimizerTrainConfig, TrainConfig
from mindspeed_llm.training import config as llm_config
from mindspeed_llm.training import sections as llm_sections
from mindspeed_mm import config as mm_config
from mindspeed_rl.config import grpo as rl_config
from mindspeed_rl.config import sections as rl_sections

#: The recipe class of each suite and the modules that define its sections.
RECIPES = {
    "llm": (llm_config.PretrainConfig, (llm_config, llm_sections)),
    "mm": (mm_config.MMConfig, (mm_config,)),
    "rl": (rl_config.GRPOConfig, (rl_config, rl_sections)),
}
#: Section -> the core class every suite's section is (or extends).
SHARED = {"checkpoint": CheckpointConfig, "train": TrainConfig, "logging": LoggingConfig}
#: Sections of llm and mm only (RL evaluates inside its ``train`` section and has no LoRA section).
SHARED_LLM_MM = {"eval": EvalConfig, "lora": LoraConfig}


def _section_types(recipe: type) -> dict[str, type]:
    return {name: hint for name, hint in typing.get_type_hints(recipe).items() if dataclasses.is_dataclass(hint)}


def test_suites_compose_the_core_sections_and_define_no_copies() -> None:
    defined: dict[str, set[str]] = {}
    for suite, (recipe, modules) in RECIPES.items():
        sections = _section_types(recipe)
        for name, core in SHARED.items():
            assert issubclass(sections[name], core), f"{suite}: {name} is {sections[name]}, not a {core.__name__}"
        assert issubclass(sections["train"], OptimizerTrainConfig) == (suite != "rl")  # RL's optimizer: the actor's
        for name, core in SHARED_LLM_MM.items():
            assert suite == "rl" or issubclass(sections[name], core), f"{suite}: {name} is not a {core.__name__}"
        for name in ("checkpoint", "logging"):  # a subclass adds keys, it copies none of the core's
            declared = (
                set(sections[name].__dict__.get("__annotations__", {})) if sections[name] is not SHARED[name] else set()
            )
            assert not declared & {f.name for f in dataclasses.fields(SHARED[name])}, (suite, name)
        for module in modules:
            for cls_name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and dataclasses.is_dataclass(cls):
                    # a class by its own name and by any alias a module gives it
                    for name in {cls_name, cls.__name__}:
                        defined.setdefault(name, set()).add(suite)
    twice = {name for name, suites in defined.items() if len(suites) > 1}
    assert not twice, f"section classes defined in more than one suite: {sorted(twice)}"
    data = [_section_types(recipe)["data"] for recipe, _ in RECIPES.values()]
    assert len({cls.__name__ for cls in data}) == 3  # three different data sections, three names


def test_keys_keep_their_order_and_names_in_messages() -> None:
    keys = [f.name for f in dataclasses.fields(llm_sections.LLMTrainConfig)]
    assert keys[:4] == ["steps", "micro_batch_size", "global_batch_size", "seed"] and keys[-1] == "deterministic"
    assert [f.name for f in dataclasses.fields(rl_sections.RLTrainConfig)][-2:] == [
        "exit_duration_mins",
        "max_nonfinite_steps",
    ]
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train.stpes' for TrainConfig; did you mean 'train.steps'"
    ):
        from_dict(mm_config.MMTrainConfig, {"stpes": 1}, "train.")
    with pytest.raises(ConfigError, match=r"'data.paht' for DataConfig; did you mean 'data.path'"):
        from_dict(rl_sections.PromptDataConfig, {"paht": 1}, "data.")

    @dataclasses.dataclass
    class Base:
        a: int = 1

    with pytest.raises(TypeError, match="are not its fields"):
        recipe_section(keys=("b",))(
            dataclasses.dataclass(type("Sub", (Base,), {"__annotations__": {"b": int}, "b": 2}))
        )


@pytest.mark.parametrize(
    "section, values, message",
    [
        (TrainConfig, {"steps": -1}, "train.steps=-1 must not be negative"),
        (TrainConfig, {"exit_duration_mins": 0.0}, "train.exit_duration_mins=0.0 must be positive (or unset)"),
        (OptimizerTrainConfig, {"lr": -1.0}, "train.lr=-1.0 must not be negative"),
        (llm_sections.LLMTrainConfig, {"lr": 0.0}, "train.lr=0.0 must be positive"),
        (OptimizerTrainConfig, {"adam_beta2": 1.0}, "train.adam_beta2=1.0 must be in [0, 1)"),
        (OptimizerTrainConfig, {"min_lr": 1.0, "lr": 0.1}, "train.min_lr=1.0 is above train.lr=0.1"),
        (llm_sections.LLMTrainConfig, {"min_lr": 1.0, "lr": 0.1}, "need train.lr_warmup_init <= train.lr"),
        (mm_config.MMTrainConfig, {"max_nonfinite_steps": -1}, "train.max_nonfinite_steps=-1 must not be negative"),
        (rl_sections.RLTrainConfig, {"steps": 0}, "train.steps=0 must be at least 1"),
        (rl_sections.RLTrainConfig, {"exit_duration_mins": -5.0}, "train.exit_duration_mins=-5.0 must be positive"),
        (EvalConfig, {"interval": 0}, "eval.interval=0 must be at least 1 (or unset)"),
        (CheckpointConfig, {"keep_last": 0}, "checkpoint.keep_last=0 must be at least 1 (or unset)"),
        (CheckpointConfig, {"override_scheduler": True, "use_checkpoint_scheduler": True}, "contradict each other"),
        (llm_sections.LLMCheckpointConfig, {"finetune": True}, "checkpoint.finetune needs checkpoint.load"),
        (llm_sections.TextDataConfig, {"split": "0,1"}, "data.split='0,1' must be up to three"),
        (mm_config.MediaDataConfig, {"cutoff_len": 0}, "data.cutoff_len=0 must be at least 1"),
        (rl_sections.PromptDataConfig, {"map_keys": {"q": "x"}}, "data.map_keys: unknown key(s) q"),
        (LoraConfig, {"r": 0}, "lora.r=0 must be at least 1"),
        (
            mm_config.MMLoraConfig,
            {"save_peft": "x"},
            "lora.save_peft needs LoRA: set lora.target_modules (e.g. [q_proj,",
        ),
        (
            llm_sections.LLMLoraConfig,
            {"target_modules": ["linear_qkv"], "r": 0},
            "lora: lora_r must be an integer >= 1",
        ),
        (llm_sections.LLMLoraConfig, {"r": 0}, None),  # LLM: the factors are checked with LoRA on only
        (
            llm_sections.LLMLoraConfig,
            {"qlora": True},
            "lora.qlora needs LoRA: set lora.target_modules (e.g. [linear_qkv,",
        ),
    ],
)
def test_each_section_checks_its_own_values(section: type, values: dict, message: str | None) -> None:
    section().check()  # the defaults are valid
    if message is None:
        section(**values).check()
        return
    with pytest.raises(ConfigError) as err:
        section(**values).check()
    assert message in str(err.value)
