"""The 2026 families trained straight from their Hugging Face directories, proven against transformers.

Each tiny model trains in one spawned gloo group of two ranks, in the layout that exercises it:

- Gemma 3 at TP2: sliding-window layers with their own rope base around a global layer with
  linear rope scaling, post-norms, (1 + w) norms, GeGLU, a scaled and tied embedding,
  query_pre_attn_scalar, a logit soft-cap;
- GLM-4.5 at EP2 (data parallel 2): q/k/v biases, QK norm, partial rotary (half of each head's
  channels rotate), head_dim not hidden / heads, a dense first layer, sigmoid routing with a
  non-zero expert bias over two expert groups, routed scaling factor 2.5, a shared expert;
- GPT-OSS at EP2: attention sinks (the registry attention's), a sliding-window layer then a full
  one, YaRN, q/k/v/o biases, router and expert biases (experts at ETP 1), the clamped SwiGLU;
- Qwen3-Next at TP2 (sequence-parallel, as MoE at TP > 1 is): Gated DeltaNet layers (in_proj and
  conv1d cut section by section, the recurrence per packed sample in SFT) around gated full
  attention, QK norm, partial rotary, (1 + w) norms, a dense first layer, renormalised top-2
  routing, a shared expert with its sigmoid gate.

The parent recomputes with transformers:

- the first pretraining loss is transformers' token-weighted mean cross-entropy over the same
  global batch (read back from the run's dataset), and the loss falls;
- the first SFT loss on packed instruction data (THD: each sample attends only to itself, the
  window, the rope tables and the partial rotary inside it) is transformers' over the samples one
  by one;
- the model exported with ``checkpoint.save_hf`` loads into transformers without missing or
  unexpected keys and gives the validation loss the run reported at its end.

(The logits of the model the trainer builds are checked for every family in test_hf_families.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset
from tests.llm.training.finetune_data import make_samples, write_instruction
from tests.llm.training.test_deepseek_v3 import _batch, _hf, _loss, _sft_loss

#: Two spawned ranks importing megatron-core and three short runs.
pytestmark = pytest.mark.slow

SEQ, MBS, GBS = 32, 2, 8
#: Family -> (its layout (space-separated overrides), learning rate, steps): enough for the loss to fall by 0.05.
FAMILIES = {
    "gemma3": ("parallel.tp=2", 3e-3, 3),
    "glm45-moe": ("parallel.ep=2", 1e-2, 5),
    "gpt-oss": ("parallel.ep=2", 1e-2, 4),
    "qwen3-next": ("parallel.tp=2 parallel.sequence_parallel=true", 1e-2, 2),
}


def _overrides(root: str, family: str, *extra: str) -> list[str]:
    layout, lr, _ = FAMILIES[family]
    return [
        f"checkpoint.load_hf={root}/hf",
        f"data.prefixes=[{root}/data]",
        f"data.seq_length={SEQ}",
        "data.split=80,20,0",
        f"train.micro_batch_size={MBS}",
        f"train.global_batch_size={GBS}",
        f"train.lr={lr}",
        "train.clip_grad=1.0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        *layout.split(),
        *extra,
    ]


def _group(rank: int, world_size: int, root: str, family: str) -> dict[str, Any]:
    import torch.distributed as dist

    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.data import build_datasets, read_tokenizer
    from mindspeed_llm.training.hf import apply_load_hf
    from mindspeed_llm.training.trainer import pretrain

    config = load_pretrain_config(
        None,
        _overrides(
            root,
            family,
            f"train.steps={FAMILIES[family][2]}",
            "eval.at_end=true",
            "eval.iters=1",
            f"checkpoint.save_hf={root}/exported",
        ),
    )
    result = pretrain(config)
    config = apply_load_hf(config)
    train, valid = build_datasets(config, dist.get_world_size(), read_tokenizer(config))
    sft = pretrain(
        load_pretrain_config(
            None, _overrides(root, family, "stage=sft", f"data.prefixes=[{root}/packed]", "train.steps=1")
        )
    )
    return {
        "losses": [record["loss"] for record in result.records],
        "sft_loss": sft.records[0]["loss"],
        "evals": result.evals,
        "train": _batch(train),
        "valid": _batch(valid),
    }


def _every_family(rank: int, world_size: int, roots: dict[str, str]) -> dict[str, dict[str, Any]]:
    # Every family's runs in one spawned group: the ranks import megatron-core and the trainer once.
    return {family: _group(rank, world_size, root, family) for family, root in roots.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    roots: dict[str, Path] = {}
    for family in FAMILIES:
        root = roots[family] = tmp_path_factory.mktemp(family)
        save_tiny_checkpoint(family, root / "hf", seed=0)
        write_indexed_dataset(root / "data", 120, seed=1)
        write_instruction(str(root / "packed"), make_samples(60, seed=0, vocab=128), pack_to=SEQ)
    results = run_distributed(_every_family, 2, {f: str(r) for f, r in roots.items()}, timeout=1200)
    return {family: {"root": roots[family], "ranks": [rank[family] for rank in results]} for family in FAMILIES}


@pytest.fixture(params=list(FAMILIES))
def run(request: pytest.FixtureRequest, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs[request.param]


@pytest.mark.distributed
def test_first_losses_equal_transformers_and_the_loss_falls(run: dict[str, Any]) -> None:
    first = run["ranks"][0]
    assert all(rank["losses"] == first["losses"] for rank in run["ranks"]), "ranks disagree on the logged losses"
    model = _hf(run["root"] / "hf")
    losses = first["losses"]
    assert losses[0] == pytest.approx(_loss(model, first["train"]), rel=1e-5)
    assert losses[-1] < losses[0] - 0.05, losses
    assert first["sft_loss"] == pytest.approx(_sft_loss(model, run["root"]), rel=1e-5)


@pytest.mark.distributed
def test_save_hf_exports_the_trained_model(run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        run["root"] / "exported", attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    first = run["ranks"][0]
    (evaluation,) = first["evals"]
    assert _loss(model.eval(), first["valid"]) == pytest.approx(evaluation["loss"], rel=1e-5)
