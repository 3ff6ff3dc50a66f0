"""``checkpoint.save_hf`` and ``convert-ckpt`` exports say the dtype they hold, so transformers loads what was trained.

A tiny Llama whose Hugging Face directory is bfloat16 trains 2 fp32 steps (lr 1e-2: updates
that bfloat16 cannot hold) in one spawned rank, which also computes the trained megatron
model's loss on a fixed batch. Its ``save_hf`` export, loaded with transformers' defaults
(``from_pretrained(path)``: dtype ``auto``, i.e. ``config.json``'s), must be float32 and
hold the trainer's weights bit for bit and give the trainer's loss; before the fix the copied
config said bfloat16 and the model loaded rounded. ``convert-ckpt`` of the run's checkpoint with
``--save-hf-dtype bfloat16`` writes bfloat16 tensors and a config that says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

#: The fixed batch both sides score: 2 sequences of 16 token ids below the data's vocabulary.
TOKENS = torch.arange(32).reshape(2, 16) * 7 % 97 + 3


def _loss(logits: torch.Tensor) -> float:
    """Mean next-token cross-entropy of ``TOKENS`` (float64 math)."""
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].double().flatten(0, 1), TOKENS[:, 1:].flatten()))


def _train(rank: int, world_size: int, root: str, prefix: str) -> dict[str, Any]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.model import unwrap
    from mindspeed_llm.training.trainer import TrainerHooks, pretrain

    out: dict[str, Any] = {}

    def score(chunks: list[Any]) -> None:
        model = unwrap(chunks[0]).eval()
        with torch.no_grad():
            logits = model(TOKENS, torch.arange(16).expand(2, 16), None)
        out["loss"] = _loss(logits.float())
        out["embedding"] = model.embedding.word_embeddings.weight.detach().numpy().copy()
        out["dtype"] = str(model.embedding.word_embeddings.weight.dtype)

    overrides = [
        f"checkpoint.load_hf={root}/hf",
        f"data.prefixes=[{prefix}]",
        "data.seq_length=16",
        "data.split=1",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.lr=1e-2",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        f"checkpoint.save={root}/ckpt",
        f"checkpoint.save_hf={root}/export",
    ]
    pretrain(load_pretrain_config(None, overrides), TrainerHooks(after_train=score))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("save-hf-dtype")
    save_tiny_checkpoint("llama2", root / "hf", seed=0, dtype=torch.bfloat16)
    prefix = write_indexed_dataset(root / "data" / "d", 40, seed=5)
    (result,) = run_distributed(_train, 1, str(root), prefix, timeout=600)
    # Sent back as numpy: tensors travel through shared memory that a finished rank no longer serves.
    result["embedding"] = torch.from_numpy(result["embedding"])
    return root, result


def _dtype_keys(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    return {k: config[k] for k in ("dtype", "torch_dtype") if k in config}


def test_save_hf_of_fp32_training_from_bf16_loads_as_trained(trained: tuple[Path, dict[str, Any]]) -> None:
    from transformers import AutoModelForCausalLM

    root, result = trained
    assert _dtype_keys(root / "hf") == {"dtype": "bfloat16"}  # the source says bf16
    assert result["dtype"] == "torch.float32"
    assert _dtype_keys(root / "export") == {"dtype": "float32"}
    model = AutoModelForCausalLM.from_pretrained(root / "export")  # transformers' defaults: dtype auto
    embedding = model.get_input_embeddings().weight.detach()
    assert embedding.dtype == torch.float32
    trainer = result["embedding"][: embedding.shape[0]]
    assert torch.equal(embedding, trainer)
    assert not torch.equal(trainer, trainer.bfloat16().float()), "training left bf16 values: nothing is proven"
    with torch.no_grad():
        loss = _loss(model.eval()(TOKENS).logits)
    assert loss == pytest.approx(result["loss"], rel=1e-6)


def test_convert_ckpt_save_hf_dtype_bfloat16(trained: tuple[Path, dict[str, Any]]) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint

    root, result = trained
    out = root / "export-bf16"
    convert_checkpoint(
        ConvertConfig(
            load_model_type="mg",
            save_model_type="hf",
            load_dir=root / "ckpt",
            save_dir=out,
            hf_cfg_dir=root / "hf",
            save_hf_dtype="bfloat16",
            progress=False,
        )
    )
    assert _dtype_keys(out) == {"dtype": "bfloat16"}
    dtypes = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(out)
    embedding = model.get_input_embeddings().weight.detach()
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, result["embedding"][: embedding.shape[0]].bfloat16())
