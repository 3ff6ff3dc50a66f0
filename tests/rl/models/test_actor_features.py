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

Then a MoE policy (a tiny Qwen3-MoE, ``moe_load_balancing`` with an aux loss and a z-loss) and a
MoE critic on it in the same process: each of two updates (other pairs the second time) reports
``load_balancing_loss`` and ``z_loss`` equal to the values recomputed by hand from the router
logits of that update's own training forwards (forward hooks on every router: the Switch loss
``E * sum_e(P_e * f_e)`` and ``mean(logsumexp^2)``, the mean over layers and microbatches, as
megatron logs them) and leaves megatron's tracker cleared (so the second is not the sum of both);
the dense actor's updates report neither. The critic is built through the actor's construction:
it has every attribute the actor has.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
ADV = torch.tensor([1.0, -1.0, 0.5])
#: The second MoE update's pairs (another batch: its own aux losses).
PAIRS2 = [([2, 6, 7], [11, 12, 13, 14]), ([9], [15, 3]), ([17, 18], [19]), ([4, 4, 4], [5, 6])]
AUX = ("load_balancing_loss", "z_loss")
MOE_FEATURES = {
    "moe_load_balancing": {"enabled": True, "type": "aux_loss", "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}
}
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
        "metric_names": sorted(metrics),
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
    out["moe"] = _moe(root, settings)
    return out


def _hand_aux_losses(chunks: list[Any]) -> tuple[dict[str, list[float]], list[Any]]:
    """Forward hooks on every router that recompute its aux losses from its logits (training forwards only)."""
    from megatron.core.transformer.moe.router import Router

    seen: dict[str, list[float]] = {name: [] for name in AUX}

    def hook(router: Any, args: tuple[Any, ...], output: Any) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            hidden = args[0].reshape(-1, args[0].shape[-1]).double()
            logits = hidden @ router.weight.double().T
            if router.bias is not None:
                logits = logits + router.bias.double()
            probs = torch.softmax(logits, -1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(router.topk, dim=1).indices, 1.0)
            tokens, experts = probs.shape
            # Switch: E * sum_e (mean prob of e) * (fraction of the top-k picks that go to e).
            balance = experts * (probs.sum(0) * chosen.sum(0)).sum() / (router.topk * tokens * tokens)
            seen["load_balancing_loss"].append(float(balance))
            seen["z_loss"].append(float(torch.logsumexp(logits, -1).square().mean()))

    modules = [m for chunk in chunks for m in chunk.modules() if isinstance(m, Router)]
    return seen, [m.register_forward_hook(hook) for m in modules]


def _moe_update(model: Any, seen: dict[str, list[float]], call: Any) -> dict[str, Any]:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    for values in seen.values():
        values.clear()
    metrics = call()
    tracker = get_moe_layer_wise_logging_tracker()
    return {
        "metrics": metrics,
        "hand": {name: sum(values) / len(values) for name, values in seen.items()},
        "forwards": len(seen["z_loss"]),
        "left": {name: float(entry["values"].abs().sum()) for name, entry in tracker.items()},
    }


def _moe(root: str, settings: Any) -> dict[str, Any]:
    """Two updates of a MoE actor and of a MoE critic, with their routers' aux losses by hand."""
    from mindspeed.features import FeaturesConfig
    from mindspeed_rl.models.actor import Actor
    from mindspeed_rl.models.critic import Critic, CriticSettings

    features = FeaturesConfig(optimization_level=0, settings=MOE_FEATURES)
    actor = Actor(f"{root}/moe", settings, features=features)
    seen, handles = _hand_aux_losses(actor.chunks)
    out: dict[str, Any] = {"routers": len(handles), "on": actor.features.enabled}
    batches = ((PAIRS, ADV), (PAIRS2, torch.tensor([0.5, -1.0, 1.0, -0.5])))
    out["actor"] = [_moe_update(actor, seen, lambda p=p, a=a: actor.update(p, None, a)) for p, a in batches]
    critic = Critic(f"{root}/moe", CriticSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0), features=features)
    seen, _ = _hand_aux_losses(critic.chunks)
    out["critic"] = []
    for pairs, _ in batches:
        width = max(len(r) for _, r in pairs)
        values = torch.zeros(len(pairs), width)
        for i, v in enumerate(critic.compute_values(pairs)):
            values[i, : len(v)] = v
        out["critic"].append(_moe_update(critic, seen, lambda p=pairs, v=values: critic.update(p, v, v + 0.5)))
    out["attributes"] = {"actor": sorted(vars(actor)), "critic": sorted(vars(critic))}
    out["critic_compiled"] = list(critic.compiled)
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
    save_tiny_checkpoint("qwen3-moe", root / "moe", seed=0)
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


def test_moe_updates_report_their_own_aux_losses(run: dict[str, Any]) -> None:
    moe = run["moe"]
    assert moe["on"] == ["moe_load_balancing"] and moe["routers"] > 0
    for role in ("actor", "critic"):
        first, second = moe[role]
        for update, pairs in ((first, PAIRS), (second, PAIRS2)):
            # One forward per router per microbatch (2 pairs a microbatch): the hooks saw this update's.
            assert update["forwards"] == moe["routers"] * -(-len(pairs) // 2), (role, update["forwards"])
            for name in AUX:
                got, want = update["metrics"][name], update["hand"][name]
                assert got == pytest.approx(want, rel=1e-5), (role, name, got, want)
            assert set(update["left"]) >= set(AUX) and not any(update["left"].values()), update["left"]
        # Other batches, other values: the second is its own, not the running sum.
        balance = [u["metrics"]["load_balancing_loss"] for u in (first, second)]
        assert abs(balance[1] - balance[0]) > 1e-4 and balance[1] < 0.9 * sum(balance), (role, balance)
    # A dense policy reports no aux loss.
    for key in ("featured", "level0"):
        assert not set(AUX) & set(run[key]["metric_names"]), run[key]["metric_names"]
    assert "update_tokens" in run["level0"]["metric_names"]


def test_a_critic_has_every_attribute_of_an_actor(run: dict[str, Any]) -> None:
    attributes = run["moe"]["attributes"]
    assert set(attributes["actor"]) <= set(attributes["critic"]), set(attributes["actor"]) - set(attributes["critic"])
    assert {"compile_watch", "compiled", "dualpipev", "transformer"} <= set(attributes["critic"])
    assert run["moe"]["critic_compiled"] == []
