"""DPO under DualPipeV (``features.settings.dualpipev.enabled=true``) equals its 1F1B run at PP2.

One spawned two-rank gloo group trains a tiny Llama with DPO from its Hugging Face directory
against a different reference model (both imported into the V's layout), 3 steps of 4 pairs
(one per microbatch: DualPipeV needs ``2 x pp``), under megatron's 1F1B and under DualPipeV (the
policy's pass and the reference's forward-only pass both run the V). Each step's loss, gradient
norm, reward accuracy / margins and chosen / rejected sequence log-probabilities equal 1F1B's
within 1e-6 (fp32), so do the evaluation's after step 3; the steps change the loss (step 1 uses
the starting weights, steps 2 and 3 the updated ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.finetune_data import write_pairwise

TOL = 1e-6
KEYS = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def _train(root: str, *extra: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    overrides = [
        f"checkpoint.load_hf={root}/hf",
        "stage=dpo",
        f"data.prefixes=[{root}/pairs]",
        "data.seq_length=32",
        "data.split=80,20,0",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "train.steps=3",
        "train.lr=2e-3",
        "train.clip_grad=1.0",
        "parallel.pp=2",
        f"dpo.ref_model={root}/ref",
        "dpo.beta=0.5",
        "eval.at_end=true",
        "eval.iters=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        *extra,
    ]
    result = pretrain(load_pretrain_config(None, overrides))
    ps.destroy_model_parallel()
    return {"records": result.records, "evals": result.evals, "features": result.features.get("order", [])}


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {"1f1b": _train(root), "dualpipev": _train(root, "features.settings.dualpipev.enabled=true")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("dpo_dualpipev")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    save_tiny_checkpoint("llama2", root / "ref", seed=1)
    write_pairwise(str(root / "pairs"), 40, seed=0, vocab=128)
    return run_distributed(_group, 2, str(root), timeout=400)


def test_dpo_dualpipev_equals_1f1b(runs: list[dict[str, Any]]) -> None:
    """Losses, reward metrics and chosen/rejected log-probs per step and at evaluation: DualPipeV = 1F1B."""
    worst: dict[str, float] = {}
    for out in runs:
        assert "dualpipev" in out["dualpipev"]["features"] and "dualpipev" not in out["1f1b"]["features"]
        plain, dual = out["1f1b"]["records"], out["dualpipev"]["records"]
        assert len(plain) == len(dual) == 3
        for a, b in zip(dual, plain):
            for key in KEYS:
                assert key in b, (key, sorted(b))
                diff = abs(a[key] - b[key])
                worst[key] = max(worst.get(key, 0.0), diff / max(1.0, abs(b[key])))
                assert diff <= TOL * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
        assert abs(plain[2]["loss"] - plain[0]["loss"]) > 1e-4  # the updates moved the policy
        (pe,), (de,) = out["1f1b"]["evals"], out["dualpipev"]["evals"]
        assert abs(de["loss"] - pe["loss"]) <= TOL * max(1.0, abs(pe["loss"])), (de, pe)
    print("dpo dualpipev vs 1f1b, max |diff| / max(1, |1f1b|) over 3 steps:", {k: f"{v:.1e}" for k, v in worst.items()})
