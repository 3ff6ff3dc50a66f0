"""``rm`` (reward-model training) proven against TRL's ``RewardTrainer`` and transformers.

One spawned group of two ranks trains a tiny Llama reward model from a Hugging Face
``LlamaForSequenceClassification`` directory at DP2, TP2 and PP2 (margin 0.3, TRL's
``center_rewards_coefficient`` 0.01), and one from a ``LlamaForCausalLM`` directory (the score
head starts fresh). The parent process checks:

- the first step's loss, accuracy and margin equal TRL's ``RewardTrainer.compute_loss`` (TRL's
  own collator and loss) on the same pairs and initial weights (rel 1e-5);
- TP2, PP2 and DP2 agree step by step, and the model trains;
- the exported directory loads with ``AutoModelForSequenceClassification`` without missing or
  unexpected keys and scores the validation pairs as the trained model did at its end (its
  loss, accuracy and margin through TRL, rel 1e-5);
- a reward model started from a language model exports as ``LlamaForSequenceClassification``
  with a pad id that is not the end-of-sequence token;
- ``convert-ckpt`` takes the score head to a TP2 Megatron checkpoint and back unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.finetune_data import write_pairwise

SEQ, MBS, GBS, MARGIN, CENTER = 32, 2, 4, 0.3, 0.01
COMMON = [
    "stage=rm",
    f"data.seq_length={SEQ}",
    "data.split=80,20,0",
    f"train.micro_batch_size={MBS}",
    f"train.global_batch_size={GBS}",
    "train.lr=2e-3",
    "train.clip_grad=1.0",
    f"rm.margin={MARGIN}",
    f"rm.center_rewards_coefficient={CENTER}",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.loss_curve=false",
]


def _train(root: str, source: str, *overrides: str) -> dict[str, Any]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    config = load_pretrain_config(
        None, [f"checkpoint.load_hf={root}/{source}", f"data.prefixes=[{root}/pairs]", *COMMON, *overrides]
    )
    result = pretrain(config)
    return {"records": result.records, "evals": result.evals}


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    end = ["eval.at_end=true", "eval.iters=1"]
    return {
        "dp2": _train(root, "hf", "train.steps=3", *end, f"checkpoint.save_hf={root}/exported"),
        "tp2": _train(root, "hf", "train.steps=3", "parallel.tp=2"),
        "pp2": _train(root, "hf", "train.steps=3", "parallel.pp=2"),
        "lm": _train(root, "lm", "train.steps=1", f"checkpoint.save_hf={root}/from_lm"),
    }


def _save_score_model(path: Path, seed: int) -> None:
    from transformers import LlamaForSequenceClassification

    from mindspeed_llm.testing.tiny_models import tiny_llama, write_tiny_tokenizer

    config = tiny_llama()
    config.num_labels, config.pad_token_id = 1, 0
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path, max_shard_size="64KB")
    write_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("rm")
    _save_score_model(root / "hf", seed=0)
    save_tiny_checkpoint("llama2", root / "lm", seed=1)
    write_pairwise(str(root / "pairs"), 40, seed=0, vocab=128)
    runs = run_distributed(_group, 2, str(root), timeout=600)[0]
    return {"root": root, "runs": runs}


def _pairs(root: Path, index: int, shuffle: bool, count: int) -> list[dict[str, np.ndarray]]:
    from mindspeed_llm.training.finetune_data import PAIRWISE_KEYS, DocumentDataset

    dataset = DocumentDataset([str(root / "pairs")], PAIRWISE_KEYS, "80,20,0", index, seed=1234, shuffle=shuffle)
    return [dataset[i] for i in range(count)]


def _trl_metrics(model_dir: Path, pairs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Loss, accuracy and margin of TRL's ``RewardTrainer.compute_loss`` on ``pairs`` (one batch)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token_id = model.config.pad_token_id
    rows = [
        {"chosen_ids": p["chosen_input_ids"][:SEQ].tolist(), "rejected_ids": p["rejected_input_ids"][:SEQ].tolist()}
        for p in pairs
    ]
    for row in rows:
        row["margin"] = MARGIN
    args = RewardConfig(
        output_dir=str(model_dir.parent / "trl"),
        per_device_train_batch_size=len(rows),
        report_to=[],
        center_rewards_coefficient=CENTER,
        use_cpu=True,
        max_length=None,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model.train(), batch))
    metrics = trainer._metrics["train"]
    return {"loss": loss, "accuracy": metrics["accuracy"][-1], "margin": metrics["margin"][-1]}


@pytest.mark.distributed
def test_first_step_equals_trl_reward_trainer(setup: dict[str, Any]) -> None:
    expected = _trl_metrics(setup["root"] / "hf", _pairs(setup["root"], 0, True, GBS))
    for layout in ("dp2", "tp2", "pp2"):
        first = setup["runs"][layout]["records"][0]
        assert first["loss"] == pytest.approx(expected["loss"], rel=1e-5), layout
        assert first["accuracy"] == pytest.approx(expected["accuracy"]), layout
        assert first["margin"] == pytest.approx(expected["margin"], rel=1e-5), layout
    assert 0 < expected["accuracy"] < 1 or abs(expected["margin"]) > 1e-3, "rewards agree: the test proves little"


@pytest.mark.distributed
def test_layouts_agree_and_the_model_trains(setup: dict[str, Any]) -> None:
    losses = {name: [r["loss"] for r in setup["runs"][name]["records"]] for name in ("dp2", "tp2", "pp2")}
    assert losses["tp2"] == pytest.approx(losses["dp2"], rel=1e-5)
    assert losses["pp2"] == pytest.approx(losses["dp2"], rel=1e-5)
    assert losses["dp2"][2] < losses["dp2"][0], "the reward model did not train"


@pytest.mark.distributed
def test_export_scores_like_the_trained_model(setup: dict[str, Any]) -> None:
    from transformers import AutoModelForSequenceClassification

    exported = setup["root"] / "exported"
    model, info = AutoModelForSequenceClassification.from_pretrained(
        exported, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    (evaluation,) = setup["runs"]["dp2"]["evals"]
    got = _trl_metrics(exported, _pairs(setup["root"], 1, False, GBS))
    assert got["loss"] == pytest.approx(evaluation["loss"], rel=1e-5)
    assert got["margin"] == pytest.approx(evaluation["margin"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(evaluation["accuracy"])


@pytest.mark.distributed
def test_reward_model_from_a_language_model_exports_as_sequence_classification(setup: dict[str, Any]) -> None:
    import json

    from transformers import AutoModelForSequenceClassification

    (first,) = setup["runs"]["lm"]["records"]
    assert np.isfinite(first["loss"])
    config = json.loads((setup["root"] / "from_lm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["pad_token_id"] is not None and config["pad_token_id"] != config.get("eos_token_id")
    _, info = AutoModelForSequenceClassification.from_pretrained(setup["root"] / "from_lm", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_convert_ckpt_round_trips_the_score_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint

    _save_score_model(tmp_path / "hf", seed=3)
    convert_checkpoint(
        ConvertConfig(load_dir=tmp_path / "hf", save_dir=tmp_path / "mg", target_tensor_parallel_size=2, progress=False)
    )
    convert_checkpoint(
        ConvertConfig(
            load_model_type="mg",
            save_model_type="hf",
            load_dir=tmp_path / "mg",
            save_dir=tmp_path / "back",
            progress=False,
        )
    )

    def read(directory: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    before, after = read(tmp_path / "hf"), read(tmp_path / "back")
    assert "score.weight" in after and "lm_head.weight" not in after
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


def test_reward_is_the_score_at_each_sequence_last_token() -> None:
    from mindspeed_llm.training.reward import bradley_terry_loss, sequence_rewards

    scores = torch.arange(10.0).reshape(1, 10, 1)
    index = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, -1, -1])  # two pairs, then padding
    assert sequence_rewards(scores, index, 4).tolist() == [2.0, 4.0, 5.0, 7.0]
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    expected = -torch.nn.functional.logsigmoid(chosen - rejected - 0.5) + 0.1 * (chosen + rejected) ** 2
    assert torch.allclose(bradley_terry_loss(chosen, rejected, 0.5, 0.1), expected)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rm.center_rewards_coefficient=-1", "rm.center_rewards_coefficient=-1.0 must be 0 or more"),
        ("parallel.sequence_parallel=true", "rm: the score head reads whole sequences"),
    ],
)
def test_bad_rm_settings_are_one_line_errors(tmp_path: Path, override: str, message: str) -> None:
    from mindspeed.config import ConfigError
    from mindspeed_llm.training.config import load_pretrain_config

    write_pairwise(str(tmp_path / "pairs"), 4, seed=0, vocab=128)
    config = load_pretrain_config(
        None, ["stage=rm", f"data.prefixes=[{tmp_path}/pairs]", "model.vocab_size=128", "parallel.tp=2", override]
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config.check(2)
