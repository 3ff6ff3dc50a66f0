"""The GRPO actor under DualPipeV (``features.settings.dualpipev.enabled=true``) equals its 1F1B run.

One spawned two-rank gloo group builds the tiny Llama's actor at PP2 twice from the same
Hugging Face directory: under megatron's 1F1B, then (megatron-core un-adapted, its parallel
state torn down) under DualPipeV, whose V puts layers 0 and 3 on rank 0 and layers 1 and 2 on
rank 1, the output layer on rank 0's second chunk. Each computes the log-probs of four pairs
(one per microbatch: DualPipeV needs ``2 x pp`` of them), runs a ``dapo`` update, computes them
again and runs a second update. Checked:

- the V's loaded weights, gathered back by ``hf_state()``, are the checkpoint's exactly (the
  V's layer placement in the Hugging Face import and export);
- the log-probs before and after the first update, the two updates' loss, gradient norm and
  entropy, and the weights after the two updates are 1F1B's within 1e-6 (fp32; measured: bit-identical), on both ranks;
- the updates moved the weights (the comparison is not of two untouched models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40]), ([6], [11, 12])]
ADV = [1.0, -1.0, 0.5, -0.25]
SCHEDULES = ("1f1b", "dualpipev")
TOL = 1e-6


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


def _run_actor(root: str, schedule: str) -> dict[str, Any]:
    from mindspeed.features import FeaturesConfig
    from mindspeed_rl.models.actor import Actor, ActorSettings

    settings = {"dualpipev": {"enabled": schedule == "dualpipev"}}
    actor = Actor(
        f"{root}/hf",
        ActorSettings.adamw(lr=1e-2, micro_batch_size=1, clip_grad=0.0, loss="dapo"),
        pp=2,
        features=FeaturesConfig(settings=settings),
    )
    try:
        out: dict[str, Any] = {"enabled": list(actor.features.enabled), "chunks": len(actor.chunks)}
        out["state0"] = {k: v.clone().numpy() for k, v in actor.hf_state().items()}
        logps, metrics = [], []
        for _ in range(2):
            logp = actor.compute_logprobs(PAIRS)
            logps.append([t.numpy() for t in logp])
            metrics.append(actor.update(PAIRS, _pad(logp), torch.tensor(ADV)))
        out["logp"], out["metrics"] = logps, metrics
        out["state2"] = {k: v.clone().numpy() for k, v in actor.hf_state().items()}
        if schedule == "dualpipev":  # 2 microbatches at PP2: refused in one line, before any work
            try:
                actor.update(PAIRS[:2], _pad(logp[:2]), torch.tensor(ADV[:2]))
            except ValueError as err:
                out["few_error"] = str(err)
    finally:
        actor.close()
    return out


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    out = {}
    for schedule in SCHEDULES:
        out[schedule] = _run_actor(root, schedule)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("actor_dualpipev")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return root, run_distributed(_group, 2, str(root), timeout=400)


def test_actor_dualpipev_equals_1f1b(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    """Log-probs, two updates' metrics and the weights after them: DualPipeV = 1F1B at PP2 (fp32, 1e-6)."""
    from transformers import AutoModelForCausalLM

    root, ranks = runs
    want = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    for out in ranks:
        plain, dual = out["1f1b"], out["dualpipev"]
        assert "dualpipev" in dual["enabled"] and "dualpipev" not in plain["enabled"]
        assert (plain["chunks"], dual["chunks"]) == (1, 2)
        assert set(dual["state0"]) == set(want)
        for name, tensor in want.items():  # the V's import and export place every layer right
            torch.testing.assert_close(torch.from_numpy(dual["state0"][name]), tensor, atol=0, rtol=0)
        for step in range(2):
            for got, ref in zip(dual["logp"][step], plain["logp"][step]):
                torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(ref), atol=TOL, rtol=0)
            for key in ("loss", "grad_norm", "entropy", "update_tokens"):
                a, b = dual["metrics"][step][key], plain["metrics"][step][key]
                assert abs(a - b) <= TOL * max(1.0, abs(b)), (step, key, a, b)
        for name in want:
            torch.testing.assert_close(
                torch.from_numpy(dual["state2"][name]), torch.from_numpy(plain["state2"][name]), atol=TOL, rtol=0
            )
        moved = max(float(abs(plain["state2"][n] - plain["state0"][n]).max()) for n in want)
        assert moved > 1e-3, moved  # the two updates moved the weights
    for out in ranks:
        assert (
            "2 microbatches, it needs >= 2 x actor.pp = 4; lower actor.micro_batch_size"
            in out["dualpipev"]["few_error"]
        )
    # The numbers of docs/core/dualpipev.md (shown with pytest -s).
    plain, dual = ranks[0]["1f1b"], ranks[0]["dualpipev"]
    logp = max(float(abs(a - b).max()) for s in range(2) for a, b in zip(dual["logp"][s], plain["logp"][s]))
    metric = {
        k: max(abs(dual["metrics"][s][k] - plain["metrics"][s][k]) for s in range(2)) for k in ("loss", "grad_norm")
    }
    weights = max(float(abs(dual["state2"][n] - plain["state2"][n]).max()) for n in want)
    print(
        f"actor dualpipev vs 1f1b: logp {logp:.1e}, loss {metric['loss']:.1e}, grad_norm {metric['grad_norm']:.1e}, "
        f"weights after 2 updates {weights:.1e} ({len(want)} tensors)"
    )
    # The two updates changed the log-probs (the second step ran on new weights).
    first, second = ranks[0]["dualpipev"]["logp"]
    assert max(float(abs(a - b).max()) for a, b in zip(first, second)) > 1e-4
