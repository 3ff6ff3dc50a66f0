"""Every feature the run report calls "on" is used by the run (house rule 11).

One spawned 2-rank group runs ``pretrain`` for 2 steps of a tiny MoE GPT at TP2 with every
feature of optimization levels 1 and 2 enabled explicitly (and the level-0 MoE features), except
``context_parallel``: this TP2 run on two ranks has no context-parallel group, without which the
feature has nothing to shard (it stays off, and the report says so; CP runs are proven in
``test_context_parallel.py``). While the run trains,

- every registry kernel call is counted by ``(op, implementation)``
  (:func:`mindspeed.testing.kernels.count_kernel_calls`: the model's modules, the patched
  rotary embedding, token permutation and the weight-gradient accumulation all call them),
  and torch's fused / multi-tensor AdamW steps are counted where the ``adamw`` kernel runs;
- every megatron ``TransformerConfig`` built is kept, with megatron's expert-parallel size at
  the time;
- every hook a feature attached is wrapped in a counter.

Then each change of the report is checked against what ran: ``kernel_impls.<op>`` must have
run that implementation, ``config_overrides.<field>`` must be the value of the model's config
(and an expert layout the parallel groups'), ``hooks.<point>`` must have been called; a target
of any other kind fails the test, as does a feature that is on without a change. A level-0
run of the same recipe reports no feature on and runs none of the optional kernels.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

LEVEL_0_MOE = ("moe_shared_experts", "moe_expert_load_metrics")
BALANCING_NAME = "load_balancing_loss"  # megatron's tracked name of the aux_loss type
NOT_IN_PRETRAIN = {
    "context_parallel": "TP2 on two ranks leaves no CP group (see test_context_parallel.py)",
    # Proven in tests/core/memory; this fp32 recipe without the distributed optimizer has
    # no master copy to reuse or swap (and the two conflict).
    "reuse_fp32_param": "needs bf16 training",
    "swap_optimizer": "needs the distributed optimizer",
    # Proven (with pretrain) in test_ripipe.py: it needs PP x VPP and a dense model.
    "recompute_in_bubble": "needs the interleaved schedule (pp x vpp) and a dense model",
    "recompute_in_advance": "needs the interleaved schedule and megatron's block recompute",
    # Proven in tests/core/megatron/test_tp2d.py (its pretrain runs check the report and config):
    # this MoE recipe at TP2 is what 2D TP refuses (experts, tp < 4).
    "tp_2d": "needs tp >= 4 and a dense model (see test_tp2d.py)",
    # A pipeline schedule: this run has no pipeline (proven, with its V layout and report, in
    # test_dualpipev.py).
    "dualpipev": "needs parallel.pp >= 2 (see test_dualpipev.py)",
}


def _settings() -> dict[str, Any]:
    from mindspeed.features import FEATURES

    settings: dict[str, Any] = {
        name: True for name, feature in FEATURES.items() if feature.level >= 1 and name not in NOT_IN_PRETRAIN
    }
    settings.update(
        {
            "moe_shared_experts": {"enabled": True, "intermediate_size": 32},
            "moe_expert_load_metrics": {"enabled": True, "per_layer": True},
            "moe_load_balancing": {"enabled": True, "type": "aux_loss", "aux_loss_coeff": 1e-2},
            "moe_router_expert_bias": {"enabled": True, "update_rate": 1e-2},
        }
    )
    return settings


def _recipe(level: int, settings: dict[str, Any]) -> Any:
    from mindspeed_llm.training.config import load_pretrain_config

    config = load_pretrain_config(
        None,
        [
            "data.mock=true",
            "data.seq_length=32",
            "model.vocab_size=128",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=4",
            "model.num_query_groups=2",
            "model.ffn_hidden_size=64",
            "model.num_moe_experts=4",
            "model.moe_router_topk=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.steps=2",
            "train.lr=1e-3",
            "logging.progress=false",
        ],
    )
    config.features.optimization_level = level
    config.features.settings = settings
    return config


def _adam_counters(calls: Counter) -> list[tuple[Any, str, Any]]:
    """Patch torch's fused and multi-tensor Adam steps (what the ``adamw`` kernels run) to count."""
    import torch
    from torch.optim import adam

    patched = []
    for owner, name, key in (
        (torch, "_fused_adamw_", ("adamw", "fused")),
        (torch, "_fused_adam_", ("adamw", "fused")),
        (adam, "_multi_tensor_adam", ("adamw", "foreach")),
    ):
        original = getattr(owner, name)

        def counting(*args: Any, _original: Any = original, _key: tuple = key, **kwargs: Any) -> Any:
            calls[_key] += 1
            return _original(*args, **kwargs)

        setattr(owner, name, counting)
        patched.append((owner, name, original))
    return patched


def _run(level: int, settings: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from mindspeed.megatron.adaptor import AdaptReport
    from mindspeed.testing.kernels import count_kernel_calls
    from mindspeed_llm.training.trainer import pretrain

    configs: list[dict[str, Any]] = []
    hook_calls: Counter = Counter()
    original_init, original_hooks = TransformerConfig.__post_init__, AdaptReport.hooks

    def recording_init(self: Any) -> None:
        original_init(self)
        ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else None
        configs.append({**{k: getattr(self, k) for k in vars(self) if not k.startswith("_")}, "_groups_ep": ep})

    def counting_hooks(self: Any) -> dict[str, tuple]:
        def wrap(point: str, fn: Any) -> Any:
            def hook(*args: Any, **kwargs: Any) -> Any:
                hook_calls[point] += 1
                return fn(*args, **kwargs)

            return hook

        return {point: tuple(wrap(point, fn) for fn in fns) for point, fns in original_hooks.fget(self).items()}

    TransformerConfig.__post_init__ = recording_init
    AdaptReport.hooks = property(counting_hooks)
    with count_kernel_calls() as calls:
        patched = _adam_counters(calls)
        try:
            result = pretrain(_recipe(level, settings))
        finally:
            for owner, name, original in patched:
                setattr(owner, name, original)
            TransformerConfig.__post_init__, AdaptReport.hooks = original_init, original_hooks
    return {
        "report": result.features,
        "calls": dict(calls),
        "hooks": dict(hook_calls),
        "configs": [
            {k: v for k, v in c.items() if isinstance(v, (bool, int, float, str, type(None)))} for c in configs
        ],
        "losses": [r["loss"] for r in result.records],
        "aux": [
            {k: v for k, v in r.items() if k.endswith("load_balancing_loss") or k == "z_loss"} for r in result.records
        ],
    }


def _group(rank: int, world_size: int) -> dict[str, Any]:
    return {"all": _run(2, _settings()), "level0": _run(0, {})}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_group, 2, timeout=600)


def _unused(run: dict[str, Any]) -> list[str]:
    """Every change of the report that the run did not exercise, as readable lines."""
    report, calls, problems = run["report"], run["calls"], []
    by_feature = Counter(change["feature"] for change in report["changes"])
    problems += [f"{name}: on without a change" for name in report["order"] if not by_feature[name]]
    model_configs = [c for c in run["configs"] if c.get("num_moe_experts")]
    for change in report["changes"]:
        seam, _, key = change["target"].partition(".")
        line = f"{change['feature']}: {change['target']} = {change['after']!r}"
        if seam == "kernel_impls":
            if not calls.get(f"{key}|{change['after']}"):
                problems.append(f"{line}: kernel never called")
        elif seam == "config_overrides":
            if not any(c.get(key) == change["after"] for c in model_configs):
                problems.append(f"{line}: not in the model's TransformerConfig")
            if key == "expert_model_parallel_size" and not any(
                c["_groups_ep"] == change["after"] for c in model_configs
            ):
                problems.append(f"{line}: megatron's expert-parallel groups differ")
        elif seam == "hooks":
            if not run["hooks"].get(key):
                problems.append(f"{line}: hook never called")
        else:
            problems.append(f"{line}: no check for seam {seam!r}; add one here")
    return problems


def _keyed(run: dict[str, Any]) -> dict[str, Any]:
    return {**run, "calls": {f"{op}|{impl}": n for (op, impl), n in run["calls"].items()}}


@pytest.mark.distributed
def test_every_feature_on_is_used_by_the_pretrain_step(runs: list[dict[str, Any]]) -> None:
    from mindspeed.features import FEATURES

    for rank_out in runs:
        run = _keyed(rank_out["all"])
        report = run["report"]
        on = set(report["order"])
        expected = {name for name, f in FEATURES.items() if f.level >= 1 or name in LEVEL_0_MOE} - set(NOT_IN_PRETRAIN)
        assert on == expected, sorted(on ^ expected)
        assert _unused(run) == []
        assert all(loss == loss for loss in run["losses"])  # finite: the features train together
    # moe_load_balancing (aux_loss here) puts megatron's logged aux loss in every train record,
    # reduced over the ranks (tests/core/megatron/test_moe_modules.py checks the value against megatron's);
    # level 0 has no balancing loss and logs none.
    all_aux = [rank_out["all"]["aux"] for rank_out in runs]
    assert all_aux[0] == all_aux[1] and len(all_aux[0]) == len(runs[0]["all"]["losses"]), all_aux
    assert all(sorted(a) == [BALANCING_NAME] and a[BALANCING_NAME] > 0 for a in all_aux[0]), all_aux[0]
    assert all(a == {} for a in runs[0]["level0"]["aux"])


@pytest.mark.distributed
def test_level_0_runs_no_optional_kernel(runs: list[dict[str, Any]]) -> None:
    run = _keyed(runs[0]["level0"])
    assert run["report"]["order"] == [] and run["report"]["changes"] == []
    fused_ops = {"matmul_add_fp32", "grouped_matmul", "moe_permute", "moe_unpermute", "adamw"}
    assert not {key for key in run["calls"] if key.split("|")[0] in fused_ops}, run["calls"]
    assert _unused(run) == []


@pytest.mark.distributed
def test_the_check_fails_a_feature_the_run_does_not_use(runs: list[dict[str, Any]]) -> None:
    run = _keyed(runs[0]["all"])
    kernel = next(k for k in run["calls"] if k.startswith("matmul_add_fp32|"))
    unused = _unused(
        {
            **run,
            "calls": {k: n for k, n in run["calls"].items() if k != kernel},
            "hooks": {**run["hooks"], "post_step": 0},
        }
    )
    hook = next(c["after"] for c in run["report"]["changes"] if c["target"] == "hooks.post_step")
    assert unused == [
        f"gradient_accumulation_fusion: kernel_impls.matmul_add_fp32 = {kernel.split('|')[1]!r}: kernel never called",
        f"moe_expert_load_metrics: hooks.post_step = {hook!r}: hook never called",
    ]
