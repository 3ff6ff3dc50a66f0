"""Tiny DeepSeek-V3 and GLM-4.5 checkpoints with multi-token-prediction layers, laid out as the released ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindspeed_llm.testing.tiny_models import TINY_CONFIGS, write_tiny_tokenizer

#: MTP layers of the tiny checkpoint.
MTP_LAYERS = 2


def save_mtp_checkpoint(path: Path, mtp_layers: int = MTP_LAYERS, seed: int = 0, family: str = "deepseek3") -> None:
    """The tiny model of ``family`` (DeepSeek-V3 or GLM-4.5) plus ``mtp_layers`` multi-token-prediction layers.

    As in DeepSeek-V3's and GLM-4.5's checkpoints, MTP layer k is ``model.layers.{num_hidden_layers + k}``: a
    decoder layer's tensors (written by transformers' own ``save_pretrained`` for a model with
    more layers, so their names and layout are transformers'), plus ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm``, and copies of the embedding (``embed_tokens``) and of the
    output head (``shared_head.head``). config.json says ``num_nextn_predict_layers``.
    """
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS.get(family)()
    layers, hidden = config.num_hidden_layers, config.hidden_size
    bigger = TINY_CONFIGS.get(family)()
    bigger.num_hidden_layers = layers + mtp_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(bigger, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path / "bigger")
    state: dict[str, torch.Tensor] = {}
    for file in (path / "bigger").glob("*.safetensors"):
        state.update(load_file(file))
    shutil.copy(path / "bigger" / "generation_config.json", path / "generation_config.json")
    shutil.rmtree(path / "bigger")
    for index in range(mtp_layers):
        prefix = f"model.layers.{layers + index}."
        state.update(
            {
                prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
                prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
                prefix + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden),
                prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
                prefix + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                prefix + "shared_head.head.weight": state["lm_head.weight"].clone(),
            }
        )
    config.num_nextn_predict_layers = mtp_layers
    config.save_pretrained(path)
    # Two shards, so that the index is exercised.
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in halves.items():
        save_file({name: state[name].contiguous() for name in part}, path / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in halves.items() for name in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_tiny_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_mtp_checkpoint(tmp_path_factory) -> Path:
    """Directory of the tiny DeepSeek-V3 checkpoint with :data:`MTP_LAYERS` MTP layers."""
    path = tmp_path_factory.mktemp("tiny-hf-mtp") / "deepseek3-mtp"
    path.mkdir()
    save_mtp_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def tiny_glm45_mtp_checkpoint(tmp_path_factory) -> Path:
    """Directory of the tiny GLM-4.5 checkpoint with :data:`MTP_LAYERS` MTP layers."""
    path = tmp_path_factory.mktemp("tiny-hf-mtp") / "glm45-mtp"
    path.mkdir()
    save_mtp_checkpoint(path, family="glm45-moe")
    return path
