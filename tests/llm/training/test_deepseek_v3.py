"""DeepSeek-V3 trained straight from its Hugging Face directory at TP2 x EP2, proven against transformers.

The tiny DeepSeek-V3 (MLA with a q LoRA, sigmoid routing with an expert bias and group-limited
top-k, routed scaling factor, a shared expert, a dense first layer) trains in one spawned gloo
group of four ranks: tensor parallelism 2 (with sequence parallelism, which megatron requires
for MoE under TP) times data parallelism 2, its experts split over expert parallelism 2 (and
expert TP 2) behind megatron's alltoall token dispatcher. The
parent recomputes with transformers:

- the logits of the model the trainer builds and loads (``build_model`` + ``load_hf_weights``),
  gathered over TP, equal transformers' on the same tokens, with default rope and with YaRN
  (megatron's ``YarnRotaryEmbedding`` and MLA's mscale, on the CPU through the adaptor);
- the first training loss is transformers' token-weighted mean cross-entropy over the same
  global batch (the samples are read back from the run's dataset);
- the loss falls over the steps;
- the first SFT loss on packed instruction data (megatron's MLA in THD layout, each sample
  attending only to itself) is transformers' over the samples one by one;
- the model exported with ``checkpoint.save_hf`` (trained weights and the expert biases the
  aux-loss-free balancing moved) loads into transformers without missing or unexpected keys
  and gives the validation loss the run reported at its end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset
from tests.llm.training.finetune_data import make_samples, write_instruction

#: Four spawned ranks importing megatron-core: over 20 s on the 2-core machine.
pytestmark = pytest.mark.slow

SEQ, MBS, GBS, STEPS = 32, 2, 8, 3
# The default alltoall dispatcher: at expert-TP 2 it gathers uneven token counts, which gloo takes
# through the adaptor's gloo-uneven-* patches.
LAYOUT = ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"]


def _overrides(root: str, *extra: str, hf: str = "hf") -> list[str]:
    return [
        f"checkpoint.load_hf={root}/{hf}",
        f"data.prefixes=[{root}/data]",
        f"data.seq_length={SEQ}",
        "data.split=80,20,0",
        f"train.micro_batch_size={MBS}",
        f"train.global_batch_size={GBS}",
        "train.lr=3e-3",
        "train.clip_grad=1.0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        *LAYOUT,
        *extra,
    ]


def _logits(config: Any, tokens: torch.Tensor) -> torch.Tensor | None:
    """The logits of the model the trainer builds from ``checkpoint.load_hf``, before any step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed.megatron import adapt, unadapt
    from mindspeed_llm.testing.megatron_logits import megatron_logits
    from mindspeed_llm.training.build import seed_everything
    from mindspeed_llm.training.hf import apply_load_hf, load_hf_weights, model_shape
    from mindspeed_llm.training.model import build_model, padded_vocab_size, recipe_transformer_config

    config = apply_load_hf(config)
    config.check(dist.get_world_size())
    vocab = padded_vocab_size(config.model.vocab_size, config.model.make_vocab_size_divisible_by, config.parallel.tp)
    adapt()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, create_gloo_process_groups=False
    )
    try:
        seed_everything(config.train.seed)
        shape = model_shape(config, config.model.vocab_size)
        transformer = recipe_transformer_config(config, shape)
        chunks = build_model(
            shape,
            config.parallel,
            transformer,
            vocab,
            trainable=False,
            bridged=True,
            prepare=lambda models: load_hf_weights(models, config.checkpoint.load_hf, config.parallel, vocab),
        )
        logits = megatron_logits(chunks, tokens)
    finally:
        ps.destroy_model_parallel()
        unadapt()
    return logits


def _batch(dataset: Any) -> dict[str, np.ndarray]:
    # numpy, not tensors: torch would pass tensors through shared memory that dies with the rank.
    rows = [dataset[i] for i in range(GBS)]
    return {key: np.stack([np.asarray(row[key]) for row in rows]) for key in ("tokens", "labels", "loss_mask")}


def _group(rank: int, world_size: int, root: str, tokens: torch.Tensor) -> dict[str, Any]:
    import torch.distributed as dist

    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.data import build_datasets, read_tokenizer
    from mindspeed_llm.training.hf import apply_load_hf
    from mindspeed_llm.training.trainer import pretrain

    logits = _logits(load_pretrain_config(None, _overrides(root)), tokens)
    yarn = _logits(load_pretrain_config(None, _overrides(root, hf="hf-yarn")), tokens)
    config = load_pretrain_config(
        None,
        _overrides(
            root, f"train.steps={STEPS}", "eval.at_end=true", "eval.iters=1", f"checkpoint.save_hf={root}/exported"
        ),
    )
    result = pretrain(config)
    # The samples of the first global batch and of the evaluation, read back as the run read them.
    config = apply_load_hf(config)
    train, valid = build_datasets(config, dist.get_world_size(), read_tokenizer(config))
    records = [{key: record[key] for key in ("step", "loss", "lr", "grad_norm")} for record in result.records]
    # SFT on packed instruction data: megatron's MLA attends within each sample (THD).
    sft = pretrain(
        load_pretrain_config(None, _overrides(root, "stage=sft", f"data.prefixes=[{root}/packed]", "train.steps=1"))
    )
    records.append({"sft_loss": sft.records[0]["loss"]})
    return {
        "logits": logits.numpy(),
        "yarn_logits": yarn.numpy(),
        "records": records,
        "evals": result.evals,
        "train": _batch(train),
        "valid": _batch(valid),
    }


#: YaRN as DeepSeek-V3 ships it (smaller numbers): megatron's YarnRotaryEmbedding and MLA's mscale.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def _save_yarn(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.testing.tiny_models import TINY_CONFIGS, write_tiny_tokenizer

    config = TINY_CONFIGS.get("deepseek3")()
    config.rope_parameters = dict(YARN)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("deepseek3")
    save_tiny_checkpoint("deepseek3", root / "hf", seed=0)
    _save_yarn(root / "hf-yarn")
    write_indexed_dataset(root / "data", 120, seed=1)
    write_instruction(str(root / "packed"), make_samples(60, seed=0, vocab=128), pack_to=SEQ)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    results = run_distributed(_group, 4, str(root), tokens, timeout=900)
    return {"root": root, "tokens": tokens, "ranks": results}


def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def _loss(model: Any, batch: dict[str, np.ndarray]) -> float:
    with torch.no_grad():
        logits = model(torch.from_numpy(batch["tokens"]).long()).logits.double()
    losses = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch["labels"]).long().flatten(), reduction="none")
    mask = torch.from_numpy(batch["loss_mask"]).double().flatten()
    return float((losses * mask).sum() / mask.sum())


@pytest.mark.distributed
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_logits_of_the_loaded_model_equal_transformers(run: dict[str, Any], rope: str) -> None:
    with torch.no_grad():
        want = _hf(run["root"] / ("hf" if rope == "default" else "hf-yarn"))(run["tokens"]).logits
    for rank in run["ranks"]:
        got = torch.from_numpy(rank["logits" if rope == "default" else "yarn_logits"])[..., : want.shape[-1]]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_first_loss_equals_transformers_and_the_loss_falls(run: dict[str, Any]) -> None:
    first = run["ranks"][0]
    assert all(rank["records"] == first["records"] for rank in run["ranks"]), "ranks disagree on the logged metrics"
    losses = [record["loss"] for record in first["records"][:STEPS]]
    assert losses[0] == pytest.approx(_loss(_hf(run["root"] / "hf"), first["train"]), rel=1e-5)
    assert losses[-1] < losses[0] - 0.05, losses


def _sft_loss(model: Any, root: Path) -> float:
    """Token-weighted mean response cross-entropy of the first global batch, each packed sample on its own."""
    from mindspeed_llm.training.finetune_data import INSTRUCTION_KEYS, DocumentDataset

    dataset = DocumentDataset([str(root / "packed")], INSTRUCTION_KEYS, "80,20,0", 0, seed=1234, shuffle=True)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in (dataset[i] for i in range(GBS)):
            mask = row["attention_mask"]
            for number in range(1, int(mask.max()) + 1):
                ids, labels = row["input_ids"][mask == number], row["labels"][mask == number]
                logits = model(torch.from_numpy(ids).long()[None]).logits[0, :-1].double()
                target = torch.from_numpy(labels[1:]).long()
                keep = target != -100
                total += float(F.cross_entropy(logits[keep], target[keep], reduction="sum"))
                count += int(keep.sum())
    return total / count


@pytest.mark.distributed
def test_first_sft_loss_on_packed_samples_equals_transformers(run: dict[str, Any]) -> None:
    got = run["ranks"][0]["records"][STEPS]["sft_loss"]
    assert got == pytest.approx(_sft_loss(_hf(run["root"] / "hf"), run["root"]), rel=1e-5)


@pytest.mark.distributed
def test_save_hf_exports_the_trained_model(run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    exported = run["root"] / "exported"
    model, info = AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    first = run["ranks"][0]
    (evaluation,) = first["evals"]
    assert _loss(model.eval(), first["valid"]) == pytest.approx(evaluation["loss"], rel=1e-5)
    # Each step moves every bias by +-1e-3 (megatron's aux-loss-free balancing); after an odd number
    # of steps none is back where it started.
    base = _hf(run["root"] / "hf").state_dict()
    biases = [name for name in base if name.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(not torch.equal(model.state_dict()[n], base[n]) for n in biases)
