"""PPO's critic started from a reward model: its value at a sequence's last token is the reward model's score.

One spawned rank builds megatron-core ``GPTModel`` chunks for a tiny ``LlamaForSequenceClassification``
(num_labels 1, weights perturbed so nothing is at its initialisation) and for a tiny
``LlamaForCausalLM``, turns them into critics with :func:`init_value_model`, and returns the
value of every token. The parent checks them against transformers:

- reward model: the value at each sequence's last token equals
  ``AutoModelForSequenceClassification``'s score of the sequence (rel 1e-5), and the value at
  every earlier token equals the score of the sequence cut there (the head reads each position);
- language model: the value head is the seeded ``N(0, std)`` draw, and the values are the
  transformers model's last hidden states (after the final norm) times that head: the decoder is
  the language model's, its ``lm_head`` left out;
- a classifier with 3 labels and a directory without config.json are one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.config import ConfigError
from mindspeed.testing.distributed import run_distributed
from mindspeed_rl.models.critic_init import read_critic_source

STD, SEED = 0.5, 7
#: Three sequences of different lengths (no token 0: the reward model's pad id).
SEQUENCES = [[5, 17, 33, 2, 90, 41, 8], [12, 3, 77, 64], [9, 9, 101, 55, 6, 30, 21, 13, 44, 3]]


def _rank(rank: int, world_size: int, sources: dict[str, str]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed.megatron import adapt, unadapt
    from mindspeed_llm.training.hf import hf_model_shape
    from mindspeed_llm.training.model import build_model, build_transformer_config, padded_vocab_size, unwrap
    from mindspeed_llm.training.sections import ParallelConfig
    from mindspeed_rl.models.critic_init import VALUE_HEAD, init_value_model

    adapt("cpu")
    out: dict[str, Any] = {}
    parallel = ParallelConfig()
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    try:
        for kind, path in sources.items():
            shape = hf_model_shape(path)
            vocab = padded_vocab_size(shape.vocab_size, 1, 1)
            transformer = build_transformer_config(shape, parallel, overrides={"perform_initialization": False})
            chunks = build_model(shape, parallel, transformer, vocab, trainable=False, bridged=True)
            init_value_model(chunks, read_critic_source(path), parallel, vocab, std=STD, seed=SEED)
            gpt = unwrap(chunks[0]).eval()
            with torch.no_grad():
                values = [
                    gpt(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), None).reshape(-1).tolist()
                    for ids in SEQUENCES
                ]
            out[kind] = {"values": values, "head": gpt.state_dict()[VALUE_HEAD].tolist()}
    finally:
        ps.destroy_model_parallel()
        unadapt()
    return out


def _save_reward_model(path: Path, labels: int = 1) -> None:
    from transformers import LlamaForSequenceClassification

    from mindspeed_llm.testing.tiny_models import tiny_llama, write_tiny_tokenizer

    config = tiny_llama()
    config.num_labels, config.pad_token_id = labels, 0
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)


@pytest.mark.distributed
def test_critic_from_a_reward_model_values_its_score_at_the_last_token(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    _save_reward_model(tmp_path / "rm")
    save_tiny_checkpoint("llama2", tmp_path / "lm", seed=1)
    assert read_critic_source(tmp_path / "rm").kind == "reward_model"
    assert read_critic_source(tmp_path / "lm").kind == "language_model"
    runs = run_distributed(_rank, 1, {"rm": str(tmp_path / "rm"), "lm": str(tmp_path / "lm")}, timeout=300)[0]

    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, values in zip(SEQUENCES, runs["rm"]["values"]):
            prefixes = torch.tensor([ids[: n + 1] + [0] * (len(ids) - n - 1) for n in range(len(ids))])
            scores = rm(prefixes, attention_mask=(prefixes != 0).long()).logits.reshape(-1)
            torch.testing.assert_close(torch.tensor(values), scores, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(runs["rm"]["head"]), rm.score.weight, rtol=0, atol=0)

    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "lm", dtype=torch.float32, attn_implementation="eager").eval()
    drawn = torch.randn((1, lm.config.hidden_size), generator=torch.Generator().manual_seed(SEED)) * STD
    torch.testing.assert_close(torch.tensor(runs["lm"]["head"]), drawn, rtol=0, atol=0)
    with torch.no_grad():
        for ids, values in zip(SEQUENCES, runs["lm"]["values"]):
            hidden = lm(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(torch.tensor(values), hidden @ drawn[0], rtol=1e-5, atol=1e-6)


def test_bad_critic_sources_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^critic.model='.*empty' has no config.json; give a Hugging Face"):
        read_critic_source(tmp_path / "empty")
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3})
    )
    with pytest.raises(ConfigError, match="is a classifier with 3 labels; a value is one number"):
        read_critic_source(tmp_path / "cls")
