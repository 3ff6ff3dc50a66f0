"""Co-location offload of the actor against the run that never offloads.

One spawned single-rank group builds two trainable actors from the same checkpoint and runs
three GRPO-style steps (log-probs, then an update with gradient clipping on) on each. The second
actor offloads its optimizer state and gradient buffers before every step's log-probs (and its
weights too at one step, twice, to exercise idempotence and the automatic onload of the
weights alone) and onloads before the update. While offloaded, every storage of Adam's state
and of the DDP gradient buffers (and ``param.main_grad``) has size 0 and ``memory()`` reports
exactly their bytes. Losses, gradient norms, every metric and the final weights must be
bit-identical to the first actor's. A frozen reference offloads its weights: its storages are
freed, and its log-probs after the automatic onload are bit-identical to those before.

The same three builds show that the RL actor, trainable and frozen, builds its model through the
LLM trainer's one build sequence (``mindspeed_llm.training.build.build_engine``; the trainer's
side is in tests/llm/training/test_fast_path.py): so a change of the build order in that one
function reaches both.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
ADV = torch.tensor([1.0, -1.0, 0.5])
STEPS = 3


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _optimizer_state(actor: Any) -> list[torch.Tensor]:
    # Independent of the actor's own bookkeeping: the inner torch optimizer's state tensors.
    opts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return [v for opt in opts for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def _grad_tensors(actor: Any) -> list[torch.Tensor]:
    grads = [b.grad_data for chunk in actor.chunks for b in chunk.buffers]
    return grads + [p.main_grad for chunk in actor.chunks for p in chunk.parameters()]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_llm.testing.build_probe import record_builds
    from mindspeed_rl.models.actor import Actor, ActorSettings

    builds = record_builds()  # who reaches the model builder (passed through; this rank exits after)

    # A warmup + cosine schedule (megatron's scheduler inside the actor, one position per update).
    settings = ActorSettings.adamw(
        lr=1e-2,
        micro_batch_size=2,
        clip_grad=0.5,
        loss="dapo",
        lr_warmup_steps=2,
        lr_decay_style="cosine",
        lr_decay_steps=STEPS + 1,
        min_lr=1e-3,
    )
    plain, offl = Actor(f"{root}/hf", settings), Actor(f"{root}/hf", settings)
    out: dict[str, Any] = {"plain": [], "offl": [], "checks": [], "builds": builds}
    for step in range(STEPS):
        old = _pad(plain.compute_logprobs(PAIRS))
        out["plain"].append(plain.update(PAIRS, old, ADV))

        state_bytes, grad_bytes = _nbytes(_optimizer_state(offl)), _nbytes(_grad_tensors(offl))
        weight_bytes = _nbytes([p for c in offl.chunks for p in c.parameters()])
        weights = step == 1
        offl.offload(optimizer=True, grad=True, weights=weights)
        moved_again = offl.offload(optimizer=True, grad=True, weights=weights)  # idempotent
        mem = offl.memory()
        check = {
            "step": step,
            "again": sum(moved_again.values()),
            "mem": mem,
            "state_bytes": state_bytes,
            "grad_bytes": grad_bytes,
            "n_state": len(_optimizer_state(offl)),
            "state_sizes": [t.untyped_storage().nbytes() for t in _optimizer_state(offl) if t.dim() > 0],
            "grad_sizes": [t.untyped_storage().nbytes() for t in _grad_tensors(offl)],
            "weight_sizes": [p.untyped_storage().nbytes() for c in offl.chunks for p in c.parameters()],
            "weight_bytes": weight_bytes,
        }
        old_offl = _pad(offl.compute_logprobs(PAIRS))  # onloads the weights only
        check["after_logp_state_sizes"] = [t.untyped_storage().nbytes() for t in _optimizer_state(offl) if t.dim() > 0]
        check["after_logp_offloaded"] = offl.memory()["offloaded_bytes"]
        check["old_equal"] = bool(torch.equal(old, old_offl))
        offl.onload()
        check["after_onload"] = offl.memory()["offloaded_bytes"]
        out["checks"].append(check)
        out["offl"].append(offl.update(PAIRS, old_offl, ADV))
    # The last step leaves the optimizer offloaded: update() must onload it by itself.
    offl.offload()
    old = _pad(plain.compute_logprobs(PAIRS))
    out["plain"].append(plain.update(PAIRS, old, ADV))
    out["offl"].append(offl.update(PAIRS, _pad(offl.compute_logprobs(PAIRS)), ADV))
    out["w_plain"] = {k: v.clone().numpy() for k, v in plain.hf_state().items()}
    out["w_offl"] = {k: v.clone().numpy() for k, v in offl.hf_state().items()}

    ref = Actor(f"{root}/hf", settings, trainable=False)
    before = ref.compute_logprobs(PAIRS)
    nothing = ref.offload()  # a frozen actor has no optimizer state or gradients
    moved = ref.offload(optimizer=False, grad=False, weights=True)
    out["ref"] = {
        "nothing": sum(nothing.values()),
        "moved": moved["weights"],
        "mem": ref.memory(),
        "sizes": [p.untyped_storage().nbytes() for c in ref.chunks for p in c.parameters()],
        "param_bytes": sum(p.numel() * p.element_size() for c in ref.chunks for p in c.parameters()),
    }
    after = ref.compute_logprobs(PAIRS)
    out["ref"]["equal"] = all(torch.equal(a, b) for a, b in zip(before, after))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("offload")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 1, str(root), timeout=300)[0]


def test_offload_run_is_bit_identical(run: dict[str, Any]) -> None:
    assert len(run["plain"]) == STEPS + 1
    for plain, offl in zip(run["plain"], run["offl"]):
        assert plain == offl  # every metric, loss and grad norm included, exactly
    assert run["plain"][0]["grad_norm"] > 0.5  # the clip (0.5) is active
    assert set(run["w_plain"]) == set(run["w_offl"])
    for name, tensor in run["w_plain"].items():
        assert (tensor == run["w_offl"][name]).all(), name
    for check in run["checks"]:
        assert check["old_equal"]


def test_offloaded_storages_are_released(run: dict[str, Any]) -> None:
    for check in run["checks"]:
        mem = check["mem"]
        assert check["again"] == 0
        assert check["grad_sizes"] and all(size == 0 for size in check["grad_sizes"])
        assert mem["offloaded_grad"] == check["grad_bytes"] > 0
        if check["step"] == 0:  # before the first step Adam has no state yet
            assert mem["offloaded_optimizer"] == 0
        else:
            # Adam's two moments per parameter: at least twice the fp32 weights.
            assert check["state_sizes"] and all(size == 0 for size in check["state_sizes"])
            assert mem["offloaded_optimizer"] == check["state_bytes"] >= 2 * check["weight_bytes"]
            # compute_logprobs brought the weights back, and nothing else.
            assert all(size == 0 for size in check["after_logp_state_sizes"])
            assert check["after_logp_offloaded"] == mem["offloaded_optimizer"] + mem["offloaded_grad"]
        if check["step"] == 1:
            assert all(size == 0 for size in check["weight_sizes"])
            assert mem["offloaded_weights"] == check["weight_bytes"]
        else:
            assert mem["offloaded_weights"] == 0
        assert mem["offloaded_bytes"] == mem["offloaded_grad"] + mem["offloaded_optimizer"] + mem["offloaded_weights"]
        assert check["after_onload"] == 0
        assert mem["host_rss"] > 0 and mem["device_allocated"] > 0


def test_reference_weights_offload(run: dict[str, Any]) -> None:
    ref = run["ref"]
    assert ref["nothing"] == 0
    assert all(size == 0 for size in ref["sizes"])
    assert ref["moved"] == ref["mem"]["offloaded_weights"] == ref["mem"]["offloaded_bytes"] == ref["param_bytes"]
    assert ref["equal"]


def test_learning_rate_follows_warmup_then_cosine(run: dict[str, Any]) -> None:
    import math

    def expected(k: int) -> float:  # update k (from 0) uses the schedule's position k
        if k < 2:
            return 1e-2 * k / 2
        progress = (k - 2) / (STEPS + 1 - 2)
        return 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi * progress))

    got = [m["lr"] for m in run["plain"]]
    assert all(math.isclose(g, expected(k), rel_tol=1e-9, abs_tol=1e-12) for k, g in enumerate(got)), got


def test_actor_builds_through_build_engine(run: dict[str, Any]) -> None:
    builds = run["builds"]
    assert [b["trainable"] for b in builds] == [True, True, False], builds
    for b in builds:
        assert b["callers"] == ["build", "build_engine"], f"the actor built its model from {b['callers']}"
