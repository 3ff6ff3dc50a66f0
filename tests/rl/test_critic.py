"""PPO's critic at TP1 and TP2, against the value loss computed by hand.

One spawned two-rank group builds the critic from a tiny Llama (``*ForCausalLM``: a fresh, seeded
value head) twice: at TP2 (both ranks one model), then, after megatron's parallel state is torn
down, at TP1 with DP2. Each computes the values of three (prompt, response) pairs packed in one
THD microbatch and runs one update of the clipped value loss against fixed returns, then the
values again. The parent checks:

- the values at TP2 equal TP1's (1e-5), and after the update (1e-3: Adam's first step);
- the reported ``vf_loss``, ``vf_clipfrac`` and ``vpred_mean`` equal the clipped loss computed
  from the returned values (the scored values are the clip centre, so the first update's values
  are the centre and nothing is clipped, the loss is ``0.5 * mean((v - G)^2)``);
- the gradient norm at TP2 equals TP1's (the value-loss gradient is the same), and the update
  moved the values (the step happened).
The TP1 layout runs as DP2 (each replica one share of the pairs): its gradient, all-reduced over
the replicas and divided by the step's token count, is the whole batch's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
RETURNS = [[1.0, 0.5, -0.2], [0.3, 0.0, 0.1, 0.9, -1.0], [2.0]]


def _pad(rows: list[Any]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for _, r in PAIRS))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row)
    return out


def _layout(root: str, tp: int, dp_rank: int, dp: int) -> dict[str, Any]:
    from mindspeed_rl.critic import Critic, CriticSettings

    settings = CriticSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, head_std=0.5, value_loss="clipped")
    critic = Critic(f"{root}/hf", settings, tp=tp)
    values = critic.compute_values(PAIRS)
    share = [i for i in range(len(PAIRS)) if i % dp == dp_rank]
    pick = torch.tensor(share)
    metrics = critic.update([PAIRS[i] for i in share], _pad(values)[pick], _pad(RETURNS)[pick])
    after = critic.compute_values(PAIRS)
    return {"values": [v.numpy() for v in values], "after": [v.numpy() for v in after], "metrics": metrics}


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    out = {"tp2": _layout(root, 2, 0, 1)}
    ps.destroy_model_parallel()
    out["dp2"] = _layout(root, 1, rank, 2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("critic")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 2, str(root), timeout=400)


def test_tp2_values_equal_tp1(runs: list[dict[str, Any]]) -> None:
    # After one Adam step (a sign-like first step: parameters with near-zero gradients amplify
    # rounding differences) the layouts agree to 1e-3; before it, to 1e-5.
    for key, tol in (("values", 1e-5), ("after", 1e-3)):
        for rank in runs:
            for a, b in zip(rank["tp2"][key], runs[0]["dp2"][key]):
                assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), atol=tol), (key, a, b)
    moved = max(abs(a - b).max() for a, b in zip(runs[0]["tp2"]["after"], runs[0]["tp2"]["values"]))
    assert moved > 1e-3


def test_value_loss_and_gradient(runs: list[dict[str, Any]]) -> None:
    from mindspeed_rl.algorithms.value_loss import ValueLossInputs, compute_value_loss

    tp2 = runs[0]["tp2"]
    values = _pad([torch.from_numpy(v) for v in tp2["values"]])
    mask = _pad([torch.ones(len(r)) for _, r in PAIRS])
    want = compute_value_loss("clipped", ValueLossInputs(values, values, _pad(RETURNS), mask), 0.5)
    got = tp2["metrics"]
    assert math.isclose(got["vf_loss"], want.metrics["vf_loss"], rel_tol=1e-5)
    assert got["vf_clipfrac"] == 0.0
    assert math.isclose(got["vpred_mean"], want.metrics["vpred_mean"], rel_tol=1e-5, abs_tol=1e-6)
    # TP2 and DP2 (the same global batch split over two replicas) take the same gradient.
    assert math.isclose(got["grad_norm"], runs[0]["dp2"]["metrics"]["grad_norm"], rel_tol=1e-5)
    assert runs[1]["tp2"]["metrics"]["grad_norm"] == got["grad_norm"]
