"""The megatron actor against transformers, and weight sync into the built-in inference engine.

One spawned single-rank group builds the actor from a tiny Llama's Hugging Face directory and:

- computes per-token log-probs of (prompt, response) pairs packed in one THD microbatch (so a
  leak across sequence boundaries would show); the parent recomputes them with transformers'
  log-softmax of the HF model's logits, sequence by sequence (1e-5);
- pushes ``hf_state()`` into an ``InferenceEngine`` loaded from a *different* checkpoint and
  compares the engine's logits with the actor's, before and after an update step (the update
  must move the logits, and the engine must follow).

A second, two-rank group builds the actor at TP2: its gathered ``hf_state()`` equals the
checkpoint's tensors exactly, and after an update the engine's scores of the sequences equal
the actor's log-probs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_llm.inference import InferenceEngine

    from mindspeed_rl.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"))
    out: dict[str, Any] = {"logp": actor.compute_logprobs(PAIRS)}
    engine = InferenceEngine.from_pretrained(f"{root}/other")
    probe = [*PAIRS[0][0], *PAIRS[0][1]]
    out["engine_before_sync"] = engine.forward_logits(probe).cpu()
    engine.load_weights(actor.hf_state())
    out["engine0"], out["actor0"] = engine.forward_logits(probe).cpu(), actor.forward_logits(probe)
    width = max(len(r) for _, r in PAIRS)
    old = torch.zeros(len(PAIRS), width)
    for i, lp in enumerate(out["logp"]):
        old[i, : len(lp)] = lp
    out["metrics"] = actor.update(PAIRS, old, torch.tensor([1.0, -1.0, 0.5]))
    engine.load_weights(actor.hf_state())
    out["engine1"], out["actor1"] = engine.forward_logits(probe).cpu(), actor.forward_logits(probe)
    # Plain arrays: tensors would travel through shared memory that dies with the rank.
    return {k: ([t.numpy() for t in v] if isinstance(v, list) else v.numpy() if torch.is_tensor(v) else v)
            for k, v in out.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("actor")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    save_tiny_checkpoint("llama2", root / "other", seed=3)
    out = run_distributed(_group, 1, str(root), timeout=300)[0]
    out = {k: ([torch.from_numpy(a) for a in v] if isinstance(v, list) else
               torch.from_numpy(v) if not isinstance(v, dict) else v) for k, v in out.items()}
    out["root"] = root
    return out


def test_logprobs_match_transformers(run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["root"] / "hf", dtype=torch.float32).eval()
    for (prompt, response), got in zip(PAIRS, run["logp"]):
        ids = torch.tensor([[*prompt, *response]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_weight_sync_engine_equals_actor(run: dict[str, Any]) -> None:
    # The engine started from other weights: equality after the sync is the sync's doing.
    assert (run["engine_before_sync"] - run["actor0"]).abs().max() > 1e-2
    torch.testing.assert_close(run["engine0"], run["actor0"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run["engine1"], run["actor1"], atol=1e-5, rtol=1e-5)
    # The update moved the weights, and the engine followed.
    assert (run["actor1"] - run["actor0"]).abs().max() > 1e-3
    assert torch.isfinite(torch.tensor(run["metrics"]["loss"]))


def _group_tp2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_llm.inference import InferenceEngine

    from mindspeed_rl.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"), tp=2)
    out: dict[str, Any] = {"state0": {k: v.clone().numpy() for k, v in actor.hf_state().items()}}
    width = max(len(r) for _, r in PAIRS)
    old = torch.zeros(len(PAIRS), width)
    for i, lp in enumerate(actor.compute_logprobs(PAIRS)):
        old[i, : len(lp)] = lp
    actor.update(PAIRS, old, torch.tensor([1.0, -1.0, 0.5]))
    engine = InferenceEngine.from_pretrained(f"{root}/other")
    engine.load_weights(actor.hf_state())
    scores = engine.score([[*p, *r] for p, r in PAIRS])
    out["engine"] = [s[len(p) - 1:].numpy() for s, (p, _) in zip(scores, PAIRS)]
    out["actor"] = [t.numpy() for t in actor.compute_logprobs(PAIRS)]
    out["old"] = [old[i, : len(r)].numpy() for i, (_, r) in enumerate(PAIRS)]
    return out


def test_tp2_weight_sync(run: dict[str, Any]) -> None:
    """At TP2 the gathered HF state is the checkpoint itself, and after an update the engine follows."""
    from transformers import AutoModelForCausalLM

    root = run["root"]
    out = run_distributed(_group_tp2, 2, str(root), timeout=300)[0]
    want = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    assert set(out["state0"]) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(torch.from_numpy(out["state0"][name]), tensor, atol=0, rtol=0)
    for engine, actor, old in zip(out["engine"], out["actor"], out["old"]):
        torch.testing.assert_close(torch.from_numpy(engine), torch.from_numpy(actor), atol=1e-5, rtol=1e-5)
    assert max(float(abs(a - o).max()) for a, o in zip(out["actor"], out["old"])) > 1e-3  # the update moved them
