"""MoE modules on the registry, one rank: grouped experts equal SequentialMLP, fused permutation
equals megatron's, the spec follows the features, checkpoints cross between the two expert
modules, the expert-load tracker counts what the experts receive; plus the MoE features.

The megatron checks run in one spawned process (megatron's MoE layer needs its process
groups); the feature and metric checks need no megatron state.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features
from mindspeed.features.moe import expert_layout
from mindspeed.metrics.moe import ExpertLoad
from mindspeed.testing.distributed import run_distributed

NUM_EXPERTS, HIDDEN = 4, 32
#: label -> TransformerConfig fields of an MoE layer compared between SequentialMLP and
#: RegistryGroupedMLP (same weights): gated SiLU (registry SwiGLU), GeGLU, plain GELU with
#: top-1 and probabilities on the input, and SwiGLU with the activation recomputed.
LAYER_CASES = {
    "swiglu-top2": dict(gated_linear_unit=True, activation_func=F.silu),
    "geglu-top2": dict(gated_linear_unit=True, activation_func=F.gelu, use_te_activation_func=False),
    "gelu-top1-probs-on-input": dict(
        gated_linear_unit=False,
        activation_func=F.gelu,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_apply_probs_on_input=True,
        use_te_activation_func=False,
    ),
    "swiglu-recompute-act": dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        moe_grouped_gemm=True,
        recompute_granularity="selective",
        recompute_modules=["moe_act"],
    ),
}


def _config(**fields: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2,
        use_cpu_initialization=True,
        add_bias_linear=False,
        use_te_activation_func=True,
        bias_activation_fusion=False,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        # Weights of std 0.5 give outputs of order 1, so the tolerances below are relative ones.
        init_method_std=0.5,
    )
    return TransformerConfig(**{**base, **fields})


def _moe_layer(config: Any, grouped: bool, impl: str = "auto") -> Any:
    from megatron.core.transformer.spec_utils import build_module

    from mindspeed.megatron.spec import get_gpt_layer_spec

    impls = {"grouped_matmul": impl, "swiglu": impl}
    # Only a SwiGLU goes through the registry activation module; others keep megatron's.
    swiglu = config.gated_linear_unit and config.activation_func is F.silu
    spec = get_gpt_layer_spec(
        impls=impls, num_experts=NUM_EXPERTS, moe_grouped_gemm=grouped, swiglu=swiglu
    ).submodules.mlp
    layer = build_module(spec, config=config)
    layer.set_layer_number(1)
    return layer


def _forward_backward(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    # Weights per output element, so every gradient path counts differently.
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _compare_layers() -> dict[str, Any]:
    from mindspeed.testing.megatron import grouped_expert_state

    results = {}
    for label, fields in LAYER_CASES.items():
        config = _config(**fields)
        sequential = _moe_layer(config, grouped=False)
        x = torch.randn(12, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
        ref_out, ref_dx, ref_grads = _forward_backward(sequential, x)
        ref_grads = grouped_expert_state(ref_grads, NUM_EXPERTS)
        for impl in ("reference", "auto"):
            grouped = _moe_layer(config, grouped=True, impl=impl)
            grouped.load_state_dict(grouped_expert_state(sequential.state_dict(), NUM_EXPERTS), strict=True)
            out, dx, grads = _forward_backward(grouped, x)
            results[f"{label}/{impl}"] = {
                "out": (out - ref_out).abs().max().item(),
                "dx": (dx - ref_dx).abs().max().item(),
                "grads": _max_diff(grads, ref_grads),
                "kernel": grouped.experts.kernel.name,
                "experts": type(grouped.experts).__name__,
                "scale": ref_out.abs().max().item(),
            }
    # No token for any local expert (an EP rank can get none): output [0, hidden], zero gradients.
    experts = _moe_layer(_config(), grouped=True).experts
    out, _ = experts(torch.zeros(0, HIDDEN), torch.zeros(NUM_EXPERTS, dtype=torch.long), torch.zeros(0))
    out.sum().backward()
    results["empty"] = {
        "shape": list(out.shape),
        "grads": [p.grad is not None and not p.grad.any() for p in experts.parameters()],
    }
    return results


def _compare_permutation() -> dict[str, float]:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from mindspeed.device import get_accelerator
    from mindspeed.megatron.moe import moe_permute_patches
    from mindspeed.ops.moe_permute import topk_routing_map
    from mindspeed.patching import PatchSet

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randn(21, 24, generator=gen)
    routing_map = topk_routing_map(21, 6, 2, gen, drop=True)
    probs = torch.rand(21, 6, generator=gen)
    patches = PatchSet(moe_permute_patches("auto", "auto"))
    diffs = {}
    for label, kwargs in {
        "probs, int count": dict(probs=probs, num_out_tokens=int(routing_map.sum())),
        "no probs, tensor count": dict(num_out_tokens=routing_map.sum()),
    }.items():
        results = []
        for patched in (False, True):
            if patched:
                patches.apply(get_accelerator())
            try:
                x = tokens.clone().requires_grad_(True)
                p = kwargs.get("probs")
                p = p.clone().requires_grad_(True) if p is not None else None
                permuted, permuted_probs, indices = token_dispatcher.permute(x, routing_map, **{**kwargs, "probs": p})
                rows = permuted * torch.linspace(0.5, 2, permuted.shape[0]).unsqueeze(1)
                out = token_dispatcher.unpermute(rows, indices, x.shape, routing_map=routing_map)
                loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
                if permuted_probs is not None:
                    loss = loss + (permuted_probs * torch.arange(permuted_probs.numel())).sum()
                loss.backward()
                results.append(
                    [permuted, indices.float(), out, x.grad] + ([permuted_probs, p.grad] if p is not None else [])
                )
            finally:
                patches.revert()
        diffs[label] = max((a - b).abs().max().item() for a, b in zip(*results))
    diffs["restored"] = float(
        token_dispatcher.permute is moe_utils.permute and token_dispatcher.unpermute is moe_utils.unpermute
    )
    return diffs


def _spec_follows_features() -> dict[str, Any]:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.moe import token_dispatcher

    from mindspeed.megatron import adapt, current_report, unadapt
    from mindspeed.megatron.spec import MindSpeedSpecProvider, get_gpt_layer_spec

    def experts(kernels: Any = None, **kwargs: Any) -> str:
        spec = get_gpt_layer_spec(kernels, num_experts=NUM_EXPERTS, **kwargs)
        return spec.submodules.mlp.submodules.experts.module.__name__

    facts = ModelFacts(num_moe_experts=NUM_EXPERTS, moe_token_dispatcher_type="alltoall")
    out = {"no features": experts(), "explicit": experts(moe_grouped_gemm=True)}
    report = current_report()
    unadapt()  # the caller's plain adapt(); re-adapted below with features
    try:
        report = adapt("cpu", features=FeaturesConfig(optimization_level=1), model=facts)
        # The spec follows the kernels it is given, never the adaptor's state.
        out["level 1, not passed"] = experts()
        out["level 1"] = experts(report.kernels)
        out["level 1, explicit False"] = experts(report.kernels, moe_grouped_gemm=False)
        out["level 1 params"] = get_gpt_layer_spec(
            report.kernels, num_experts=NUM_EXPERTS
        ).submodules.mlp.submodules.experts.params
        out["level 1 patches"] = [p.name for p in report.patches if "permute" in p.name]
        out["patched"] = token_dispatcher.permute.__module__
        backend = get_moe_module_spec_for_backend(
            MindSpeedSpecProvider(report.kernels), num_experts=NUM_EXPERTS, moe_grouped_gemm=True
        )
        out["backend"] = backend.submodules.experts.module.__name__
        unadapt()
        off = adapt("cpu", features=FeaturesConfig(settings={"moe_grouped_gemm": False}), model=facts)
        out["grouped off"] = experts(off.kernels)
    finally:
        unadapt()
        adapt("cpu")
    return out


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    # megatron's torch_dist save forks writer processes; the harness's ranks are daemonic.
    process = multiprocessing.current_process()
    daemon, process.daemon = process.daemon, False
    try:
        yield
    finally:
        process.daemon = daemon


def _checkpoint_crosses_modules(directory: str) -> dict[str, float]:
    from megatron.core import dist_checkpointing

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.testing.megatron import ParallelSizes as Sizes
    from mindspeed.testing.megatron import TinyGPTConfig, build_gpt, full_state, grouped_expert_state, unwrap

    model = TinyGPTConfig(num_layers=2, num_experts=NUM_EXPERTS)
    diffs = {}
    for first, second in ((False, True), (True, False)):
        built = {}
        for grouped in (first, second):
            # swiglu=False: the toolkit config keeps megatron's own glu activation (use_te_activation_func off).
            spec = get_gpt_layer_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=grouped, swiglu=False)
            torch.manual_seed(11 if grouped == first else 12)  # different initial weights
            built[grouped] = unwrap(build_gpt(model, Sizes(), layer_spec=spec)[0])
        path = Path(directory) / ("grouped" if first else "sequential")
        path.mkdir()
        with _children_allowed():
            dist_checkpointing.save(built[first].sharded_state_dict(), path, async_sharded_save=False)
        state = dist_checkpointing.load(built[second].sharded_state_dict(), path)
        built[second].load_state_dict(state)
        saved = grouped_expert_state(full_state([built[first]]), NUM_EXPERTS)
        loaded = grouped_expert_state(full_state([built[second]]), NUM_EXPERTS)
        diffs[f"{'grouped' if first else 'sequential'} -> {'grouped' if second else 'sequential'}"] = _max_diff(
            loaded, saved
        )
    return diffs


def _tracker_counts() -> dict[str, Any]:
    from mindspeed.metrics.moe import ExpertLoadTracker

    out = {}
    for label, fields in {
        "plain": {},
        "moe recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    }.items():
        config = _config(**fields)
        layers = [_moe_layer(config, grouped=True) for _ in range(2)]
        for number, layer in enumerate(layers, start=1):
            layer.set_layer_number(number)
        received: dict[int, torch.Tensor] = {}

        def record(number: int) -> Any:
            def hook(module: Any, args: tuple) -> None:
                if torch._C._current_graph_task_id() == -1:  # not a recompute inside the backward
                    received[number] = received.get(number, 0) + args[1]

            return hook

        for number, layer in enumerate(layers, start=1):
            layer.experts.register_forward_pre_hook(record(number))
        tracker = ExpertLoadTracker().attach(torch.nn.ModuleList(layers))
        x = torch.randn(10, 2, HIDDEN, generator=torch.Generator().manual_seed(3), requires_grad=True)
        for _ in range(2):  # two microbatches add up
            h = x
            for layer in layers:
                h = layer(h)[0]
            h.sum().backward()
        load = tracker.log_step(0)
        out[label] = {
            "tracked": load.counts,
            "received": {n: c.tolist() for n, c in received.items()},
            "text": load.describe(),
            "history": len(tracker.history),
        }
        tracker.detach()
    return out


def _aux_losses() -> dict[str, Any]:
    """A step's aux losses as the trainer reads them (moe_aux_losses) and as megatron's track_moe_metrics logs them."""
    import copy

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    from mindspeed.metrics.moe import aux_loss_names, moe_aux_losses, moe_layer_count

    config = _config(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss")
    layers = [_moe_layer(config, grouped=True) for _ in range(2)]
    for number, layer in enumerate(layers, start=1):
        layer.set_layer_number(number)
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()

    def step() -> None:
        for micro in range(3):  # three microbatches add up in the tracker
            h = torch.randn(10, 2, HIDDEN, generator=torch.Generator().manual_seed(micro), requires_grad=True)
            for layer in layers:
                h = layer(h)[0]
            h.sum().backward()

    step()
    snapshot = copy.deepcopy({name: {"values": entry["values"]} for name, entry in tracker.items()})
    ours = moe_aux_losses(config, 3, "cpu")
    cleared = {name: entry["values"].abs().sum().item() for name, entry in tracker.items()}
    tracker.clear()
    tracker.update(snapshot)
    theirs: dict[str, torch.Tensor] = {}
    track_moe_metrics(1 / 3, 0, total_loss_dict=theirs, num_layers=config.num_layers, moe_layer_freq=1)
    step()  # a second step reads its own losses, not the sum of both
    second = moe_aux_losses(config, 3, "cpu")
    return {
        "names": aux_loss_names(config),
        "layers": moe_layer_count(config),
        "ours": ours,
        "theirs": {name: value.item() for name, value in theirs.items()},
        "cleared": cleared,
        "second": second,
        "dense": moe_aux_losses(_config(num_moe_experts=None, moe_router_topk=2), 3, "cpu"),
    }


def _megatron_checks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.testing.megatron import ParallelSizes as Sizes
    from mindspeed.testing.megatron import destroy_parallel, init_parallel

    adapt("cpu")
    init_parallel(Sizes())
    try:
        return {
            "layers": _compare_layers(),
            "permutation": _compare_permutation(),
            "spec": _spec_follows_features(),
            "checkpoint": _checkpoint_crosses_modules(directory),
            "tracker": _tracker_counts(),
            "aux": _aux_losses(),
        }
    finally:
        destroy_parallel()
        unadapt()


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (out,) = run_distributed(_megatron_checks, 1, str(tmp_path_factory.mktemp("moe_ckpt")), timeout=300)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", [f"{label}/{impl}" for label in LAYER_CASES for impl in ("reference", "auto")])
def test_grouped_experts_equal_sequential(megatron_results: dict[str, Any], case: str) -> None:
    row = megatron_results["layers"][case]
    assert row["experts"] == "RegistryGroupedMLP"
    assert row["kernel"] == ("reference" if case.endswith("reference") else "native")
    assert row["scale"] > 0.1, "the layer output is about zero: the comparison proves little"
    for key in ("out", "dx", "grads"):  # 0 on the CPU; fp32 rounding of other kernels elsewhere
        assert row[key] < 1e-6 * row["scale"], (case, key, row[key])


@pytest.mark.distributed
def test_grouped_experts_without_tokens(megatron_results: dict[str, Any]) -> None:
    empty = megatron_results["layers"]["empty"]
    assert empty["shape"] == [0, HIDDEN] and empty["grads"] == [True, True]


@pytest.mark.distributed
def test_fused_permutation_equals_megatron(megatron_results: dict[str, Any]) -> None:
    diffs = megatron_results["permutation"]
    assert diffs.pop("restored") == 1.0, "revert did not restore megatron's permute/unpermute"
    for label, diff in diffs.items():
        assert diff < 1e-6, (label, diff)


@pytest.mark.distributed
def test_spec_follows_moe_grouped_gemm_feature(megatron_results: dict[str, Any]) -> None:
    spec = megatron_results["spec"]
    assert spec["no features"] == "SequentialMLP" and spec["explicit"] == "RegistryGroupedMLP"
    assert spec["level 1"] == "RegistryGroupedMLP" and spec["level 1, explicit False"] == "SequentialMLP"
    assert spec["level 1, not passed"] == "SequentialMLP"  # no kernels given: nothing read from adapt()
    assert spec["level 1 params"] == {"impl": "native", "swiglu_impl": "native"}
    assert spec["level 1 patches"] == ["moe-permute-kernel", "moe-unpermute-kernel"]
    assert spec["patched"] == "mindspeed.megatron.moe"
    assert spec["backend"] == "RegistryGroupedMLP"
    assert spec["grouped off"] == "SequentialMLP"


@pytest.mark.distributed
def test_checkpoints_cross_between_expert_modules(megatron_results: dict[str, Any]) -> None:
    for direction, diff in megatron_results["checkpoint"].items():
        assert diff == 0.0, direction


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["plain", "moe recompute"])
def test_tracker_counts_what_experts_receive(megatron_results: dict[str, Any], label: str) -> None:
    row = megatron_results["tracker"][label]
    assert row["tracked"] == row["received"] and sorted(row["tracked"]) == [1, 2]
    # 2 microbatches of 20 tokens, top-2: 80 routed tokens per layer.
    assert all(sum(counts) == 2 * 20 * 2 for counts in row["tracked"].values())
    assert row["history"] == 1 and "layer 2: tokens per expert" in row["text"]


# -- features and metrics (no megatron state) ------------------------------------------------------

MOE = ModelFacts(num_moe_experts=8, moe_token_dispatcher_type="alltoall", extra={"moe_ffn_hidden_size": 96})


def _apply(
    settings: dict[str, Any], parallel: ParallelSizes = ParallelSizes(), model: ModelFacts = MOE, level: int = 2
) -> BuildContext:
    ctx = BuildContext(accelerator="cpu", parallel=parallel, model=model)
    # Only the MoE features' config fields are under test here (fusion sets its own flag).
    settings = {"gradient_accumulation_fusion": False, **settings}
    apply_features(FeaturesConfig(optimization_level=level, settings=settings), ctx)
    return ctx


def test_moe_model_features_are_opt_in() -> None:
    ctx = _apply({})
    assert not {k for k in ctx.config_overrides if k.startswith(("moe_", "expert_"))}
    assert not ctx.hooks["post_step"]


def test_tp_extend_ep_maps_onto_expert_groups() -> None:
    ctx = _apply({"moe_tp_extend_ep": True}, ParallelSizes(tp=2, ep=2, dp=4))
    assert dict(ctx.config_overrides) == {"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1}
    assert expert_layout(ctx.config_overrides, ep=2) == (4, 1)
    assert expert_layout({}, ep=2) == (2, None)
    with pytest.raises(ValueError, match=r"num_moe_experts=6 is not divisible .* tp \* ep = 2 \* 2 = 4"):
        _apply({"moe_tp_extend_ep": True}, ParallelSizes(tp=2, ep=2), ModelFacts(num_moe_experts=6))
    with pytest.raises(ValueError, match="tensor-parallel size is 1"):
        _apply({"moe_tp_extend_ep": True}, ParallelSizes(ep=2))
    with pytest.raises(ValueError, match="no routed experts"):
        _apply({"moe_tp_extend_ep": True}, ParallelSizes(tp=2), ModelFacts(num_moe_experts=0))


def test_shared_experts_width() -> None:
    assert _apply({"moe_shared_experts": {"enabled": True, "intermediate_size": 128}}).config_overrides == {
        "moe_shared_expert_intermediate_size": 128
    }
    ctx = _apply({"moe_shared_experts": {"enabled": True, "n_shared_experts": 2, "overlap": True}})
    assert ctx.config_overrides["moe_shared_expert_intermediate_size"] == 2 * MOE.extra["moe_ffn_hidden_size"]
    assert ctx.config_overrides["moe_shared_expert_overlap"] is True
    with pytest.raises(ValueError, match="exactly one of"):
        _apply({"moe_shared_experts": True})
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        _apply({"moe_shared_experts": {"enabled": True, "n_shared_experts": 1}}, model=ModelFacts(num_moe_experts=4))
    with pytest.raises(ValueError, match="alltoall dispatcher"):
        _apply(
            {"moe_shared_experts": {"enabled": True, "intermediate_size": 8, "overlap": True}},
            model=ModelFacts(num_moe_experts=4, moe_token_dispatcher_type="allgather"),
        )


def test_load_balancing_and_expert_bias() -> None:
    ctx = _apply(
        {
            "moe_load_balancing": {
                "enabled": True,
                "type": "seq_aux_loss",
                "aux_loss_coeff": 1e-3,
                "z_loss_coeff": 1e-3,
            },
            "moe_router_expert_bias": {"enabled": True, "update_rate": 1e-2},
        }
    )
    assert dict(ctx.config_overrides) == {
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 1e-3,
        "moe_z_loss_coeff": 1e-3,
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 1e-2,
        "moe_router_score_function": "sigmoid",
    }
    for bad, match in (
        (dict(type="switch"), "not one of"),
        (dict(aux_loss_coeff=0.0), "adds no loss"),
        (dict(type="sinkhorn"), "has no auxiliary loss"),
    ):
        with pytest.raises(ValueError, match=match):
            _apply({"moe_load_balancing": {"enabled": True, **bad}})
    with pytest.raises(ValueError, match="does not move the bias"):
        _apply({"moe_router_expert_bias": {"enabled": True, "update_rate": 0.0}})


def test_expert_load_metrics_feature_adds_hooks() -> None:
    ctx = _apply({"moe_expert_load_metrics": {"enabled": True, "interval": 10}})
    (attach,), (log,) = ctx.hooks["post_model_build"], ctx.hooks["post_step"]
    assert attach.__self__ is log.__self__ and log.__self__.interval == 10
    assert log(0) is None, "a step that is not logged must not collect (collect is a collective)"


def test_expert_load_summary() -> None:
    counts = {1: [30, 10, 0, 40], 3: [20, 20, 20, 20]}
    load = ExpertLoad(step=7, counts=counts)
    for layer, row in counts.items():
        t = torch.tensor(row, dtype=torch.float64)
        assert load.imbalance(layer) == pytest.approx((t.max() / t.mean()).item())
    assert load.max_imbalance == load.imbalance(1) and load.imbalance(3) == 1.0
    scalars = load.to_dict()
    assert scalars["moe/expert_load_imbalance"] == load.imbalance(1)
    assert scalars["moe/layer_1/expert_3_tokens"] == 40.0
    assert load.describe().splitlines()[0].startswith("expert load at step 7: max/mean 2.000 (layer 1)")
    assert ExpertLoad(step=0).max_imbalance == 1.0


@pytest.mark.distributed
def test_aux_losses_read_as_megatron_logs_them(megatron_results: dict[str, Any]) -> None:
    # The trainer's train records carry these (mindspeed_llm.training.trainer: moe_aux_losses each step).
    aux = megatron_results["aux"]
    assert aux["names"] == ["load_balancing_loss", "z_loss"] and aux["layers"] == 2
    assert sorted(aux["ours"]) == sorted(aux["theirs"]) == aux["names"], aux
    for name, value in aux["theirs"].items():
        assert value > 0, f"{name}: no loss tracked, a vacuous check"
        assert aux["ours"][name] == pytest.approx(value, rel=1e-6), name
    assert all(v == 0 for v in aux["cleared"].values()), "the tracker was not cleared after the read"
    # A second step with other inputs is read alone (the tracker does not add up over a run).
    for name, value in aux["second"].items():
        assert 0 < value < 2 * aux["ours"][name], (name, value)
    assert aux["dense"] == {}
