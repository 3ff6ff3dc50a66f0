"""RewardModel on a tiny randomly initialised sequence-classification model vs transformers directly."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.rewards import RewardModel, build_reward, score_batch


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from mindspeed_llm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("demo")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


TEXTS = [
    "What is 2 + 2? The answer is 4.",
    "Hi",
    "A much longer text that needs a lot of padding in a batch, " * 3,
    "#### 72",
    "Another one.",
]


def test_scores_equal_transformers_one_text_at_a_time(reward_dir) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = RewardModel(reward_dir, device="cpu", batch_size=3)  # batches of 3 and 2, padded
    got = rm.score(TEXTS)
    reference = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    with torch.no_grad():
        expected = torch.stack([reference(**tokenizer(t, return_tensors="pt")).logits[0, 0] for t in TEXTS])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.std() > 0  # distinct texts get distinct scores
    prompts, responses = ["What is 2 + 2? ", "Hi"], ["The answer is 4.", ""]
    assert score_batch(rm, prompts, responses) == pytest.approx(expected[:2].tolist(), rel=1e-5, abs=1e-5)
    assert rm("Hi", "", None) == pytest.approx(expected[1].item(), rel=1e-5, abs=1e-5)
    total, parts = build_reward(["format"], weights=[0.0, 2.0], extra={"rm": rm}).score_batch(prompts, responses)
    torch.testing.assert_close(total, 2 * expected[:2], rtol=1e-5, atol=1e-5)


def test_bad_directory_and_label(reward_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        RewardModel(tmp_path)
    with pytest.raises(ValueError, match="label 1 is out of range"):
        RewardModel(reward_dir, device="cpu", label=1)


def test_pads_with_the_config_pad_id_when_the_tokenizer_pads_with_another(reward_dir, tmp_path) -> None:
    """``mindspeed-llm rm``'s export: config pad id 0, tokenizer padding with EOS; batched = one at a time."""
    import json
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "rm"
    shutil.copytree(reward_dir, path)
    config = json.loads((path / "config.json").read_text())
    tokenizer_pad = AutoTokenizer.from_pretrained(reward_dir).pad_token_id
    config["pad_token_id"] = 0 if tokenizer_pad != 0 else 1
    (path / "config.json").write_text(json.dumps(config))
    rm = RewardModel(path, device="cpu", batch_size=5)
    one_by_one = torch.stack([rm.score([t])[0] for t in TEXTS])
    torch.testing.assert_close(rm.score(TEXTS), one_by_one, rtol=1e-5, atol=1e-5)
