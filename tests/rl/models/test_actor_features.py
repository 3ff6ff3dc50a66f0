"""The actor's ``features:`` section: what its report calls on is what its update runs.

One spawned single-rank group builds a trainable actor from a tiny Llama with gradient-
accumulation fusion, fused SwiGLU and fused AdamW on (everything else at level 0) and runs one
update while every registry kernel call is counted: the report lists exactly those three
features, the update called ``matmul_add_fp32`` once per linear layer per microbatch and the
``swiglu`` kernel it names, and the optimizer's parameter groups run torch's fused AdamW. A
second actor with other features in the same process is refused while the first holds the
adaptation; after ``close()`` megatron-core is unadapted and an actor at level 0 reports no
feature, runs only reference kernels and megatron's own AdamW loop, and reaches the same loss
and gradient norm (the features change kernels, not numbers: 1e-5). Last, the memory features
reach the actor's training: with ``recompute_activation_function`` (level 0 otherwise) two GRPO
updates give the level-0 actor's losses and gradient norms bit for bit, while the activation
outputs of every layer were discarded in each forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
ADV = torch.tensor([1.0, -1.0, 0.5])
ON = ("fused_swiglu", "fused_adamw", "gradient_accumulation_fusion")


def _update(actor: Any) -> dict[str, Any]:
    from mindspeed.testing.kernels import count_kernel_calls

    with count_kernel_calls() as calls:
        metrics = actor.update(PAIRS, None, ADV)
    groups = [
        g for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]) for g in o.optimizer.param_groups
    ]
    report = actor.features
    return {
        "on": report.enabled,
        "kernels": dict(report.kernel_impls),
        "calls": dict(calls),
        "fused_adam": {bool(g.get("fused")) for g in groups},
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "linears": sum(1 for m in actor.chunks[0].modules() if type(m).__name__.endswith("ParallelLinear")),
    }


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed.features import FeaturesConfig
    from mindspeed.megatron import current_report
    from mindspeed_llm.training.model import unwrap
    from mindspeed_rl.models.actor import Actor, ActorSettings

    settings = ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo", compute_entropy=False)
    chosen = FeaturesConfig(optimization_level=0, settings={name: True for name in ON})
    actor = Actor(f"{root}/hf", settings, features=chosen)
    out = {"featured": _update(actor)}
    try:
        Actor(f"{root}/hf", settings, features=FeaturesConfig(optimization_level=0))
    except ValueError as err:
        out["refused"] = str(err)
    actor.close()
    out["unadapted"] = current_report() is None
    plain = Actor(f"{root}/hf", settings, features=FeaturesConfig(optimization_level=0))
    out["level0"] = _update(plain)
    out["level0"]["second"] = _losses(plain)
    plain.close()
    recompute = FeaturesConfig(optimization_level=0, settings={"recompute_activation_function": True})
    actor = Actor(f"{root}/hf", settings, features=recompute)
    out["recompute"] = {"on": actor.features.enabled, "first": _losses(actor), "second": _losses(actor)}
    installed = [h.__self__.installed for h in actor.adaptation.hooks["post_model_build"]]
    out["recompute"]["discarded"] = sum(i.discarded for i in installed)
    out["recompute"]["layers"] = sum(i.layers for i in installed)
    out["recompute"]["model_layers"] = sum(len(unwrap(chunk).decoder.layers) for chunk in actor.chunks)
    actor.close()
    return out


def _losses(actor: Any) -> tuple[float, float]:
    metrics = actor.update(PAIRS, None, ADV)
    return metrics["loss"], metrics["grad_norm"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("actor-features")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 1, str(root), timeout=300)[0]


def test_features_on_are_reported_and_used(run: dict[str, Any]) -> None:
    featured = run["featured"]
    assert sorted(featured["on"]) == sorted(ON)
    kernels, calls = featured["kernels"], featured["calls"]
    microbatches = -(-len(PAIRS) // 2)
    assert calls.get(("matmul_add_fp32", kernels["matmul_add_fp32"])) == microbatches * featured["linears"]
    assert calls.get(("swiglu", kernels["swiglu"]))
    assert kernels["adamw"] == "fused" and featured["fused_adam"] == {True}
    assert "already adapted in this process with features" in run["refused"]


def test_level_0_uses_none_and_trains_the_same(run: dict[str, Any]) -> None:
    assert run["unadapted"]
    plain = run["level0"]
    assert plain["on"] == [] and plain["kernels"] == {}
    assert {impl for _, impl in plain["calls"]} == {"reference"}
    assert not any(op == "matmul_add_fp32" for op, _ in plain["calls"])
    assert plain["fused_adam"] == {False}
    featured = run["featured"]
    assert abs(plain["loss"] - featured["loss"]) < 1e-5
    assert abs(plain["grad_norm"] - featured["grad_norm"]) < 1e-5 * max(1.0, plain["grad_norm"])


def test_activation_recompute_in_the_actor_gives_the_same_updates_bit_for_bit(run: dict[str, Any]) -> None:
    plain, recompute = run["level0"], run["recompute"]
    assert recompute["on"] == ["recompute_activation_function"]
    assert recompute["first"] == (plain["loss"], plain["grad_norm"])
    assert recompute["second"] == plain["second"]
    # Every layer's activation output was dropped in every microbatch's forward of both updates.
    microbatches = -(-len(PAIRS) // 2)
    assert recompute["layers"] == recompute["model_layers"] > 0
    assert recompute["discarded"] == 2 * microbatches * recompute["layers"]
