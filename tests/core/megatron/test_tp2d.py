"""2D tensor parallelism (the ``tp_2d`` feature): 2x2 on 4 ranks = 1D TP4 = one rank.

One spawned 4-rank gloo group (fp32) checks:

- units: the 2D column linear (stride 1, and stride 2 as SwiGLU's fc1), the row linear and the
  distributed RMSNorm / LayerNorm on a 2x2 grid against the dense ops: outputs, input
  gradients, weight (and norm weight / bias) gradients;
- the model: the tiny GPT (2 layers, GQA, SwiGLU, RMSNorm) trained 3 Adam steps (clipped) as
  one rank (TP1, the same batch on every rank), 1D TP4 and 2D TP 2x2: the losses of every step,
  every parameter's gradient of the first step against the single-rank gradient (cut to this
  rank's block), and the weights after 3 steps (2D exported to the 1D layout against 1D TP4's);
- checkpoints: the 2D model starts from noise, loads 1D TP4's initial state
  (``load_1d_state_into_tp2d``), and its export (``tp2d_to_1d_state``) equals that state exactly;
  megatron's sharded state declares the same keys as 1D's;
- pipeline and sequence parallelism: PP2 x TP2 as 1D TP and as the 2D grids 2x1, 1x2 and 1x2
  with megatron's SP (each axis alone; 2x2 at PP2 needs 8 ranks, checked by hand,
  docs/core/tensor-parallel-2d.md): 3 Adam steps, equal losses and gradient norms; 2x2 with SP
  (the chunk's input and output in SP's ``[s / tp, b, h]``) against one rank's losses;
- the ``mindspeed-llm pretrain`` recipe (TP4, constant learning rate): 1D trains 4 steps saving at
  2 and 4; a ``tp_2d`` run resumes from 1D's step-2 distributed checkpoint (optimizer included)
  and saves step 3; a 1D run resumes from that for step 4: the losses of steps 3 and 4 equal the
  uninterrupted 1D run's, and the report lists ``tp_2d`` only in the 2D run.

The feature's refusals are checked in-process.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

STEPS, LAYERS = 3, 2
#: fp32, different summation orders (2D sums a row GEMM over in / tp_x then over x; 1D over in / tp
#: then over all tp): measured differences are ~1e-7; the bound leaves a margin of about 10x.
TOL = 2e-6
#: Weights after 3 Adam steps: Adam divides by the root of the second moment, so a 1e-7 difference of
#: a near-zero gradient element moves its update by up to ~lr; measured up to 7.8e-6 at lr 3e-3.
WEIGHT_TOL = 3e-5


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _units() -> dict[str, float]:
    import torch.distributed as dist

    from mindspeed.megatron.tp2d import (
        Tp2dColumnParallelLinear,
        Tp2dNorm,
        Tp2dRowParallelLinear,
        _shard_1d,
        column_block,
        row_block,
    )
    from mindspeed.ops.norms import rms_norm_reference
    from mindspeed.parallel.tp2d import build_tp2d_groups, enter_2d, exit_2d

    g = build_tp2d_groups(dist.group.WORLD, 2, 2)
    rank, out = dist.get_rank(), {}
    gen = torch.Generator().manual_seed(7)
    s, b, h, o = 8, 2, 16, 24
    config = SimpleNamespace(
        perform_initialization=False,
        params_dtype=torch.float32,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=False,
    )
    for stride in (1, 2):  # column linear
        x = torch.randn(s, b, h, generator=gen, requires_grad=True)
        w = torch.randn(o, h, generator=gen, requires_grad=True)
        gout = torch.randn(s, b, o, generator=gen)
        dense = torch.nn.functional.linear(x, w)
        (dense * gout).sum().backward()
        mod = Tp2dColumnParallelLinear(
            h, o, config=config, init_method=None, bias=False, stride=stride, tp_group=dist.group.WORLD, tp_x=2, tp_y=2
        )
        with torch.no_grad():
            mod.weight.copy_(column_block(w.detach(), g, stride))
        x2 = x.detach().clone().requires_grad_()
        y, _ = mod(enter_2d(x2, g))
        y.backward(_shard_1d(gout, rank, 4, stride, dim=-1))
        out[f"column{stride} out"] = _maxdiff(y, _shard_1d(dense.detach(), rank, 4, stride, dim=-1))
        out[f"column{stride} dx"] = _maxdiff(x2.grad, x.grad)
        out[f"column{stride} dw"] = _maxdiff(mod.weight.grad, column_block(w.grad, g, stride))
    # row linear: input this rank's 1D feature shard, output the 2D block
    x = torch.randn(s, b, o, generator=gen, requires_grad=True)
    w = torch.randn(h, o, generator=gen, requires_grad=True)
    bias = torch.randn(h, generator=gen, requires_grad=True)
    gout = torch.randn(s, b, h, generator=gen)
    dense = torch.nn.functional.linear(x, w, bias)
    (dense * gout).sum().backward()
    mod = Tp2dRowParallelLinear(
        o, h, config=config, init_method=None, bias=True, tp_group=dist.group.WORLD, tp_x=2, tp_y=2
    )
    with torch.no_grad():
        mod.weight.copy_(row_block(w.detach(), g))
        mod.bias.copy_(bias.detach())
    x2 = _shard_1d(x.detach(), rank, 4, dim=-1).requires_grad_()
    y, _ = mod(x2)
    full = exit_2d(y, g)
    full.backward(gout)
    out["row out"] = _maxdiff(full, dense.detach())
    out["row dx"] = _maxdiff(x2.grad, _shard_1d(x.grad, rank, 4, dim=-1))
    out["row dw"] = _maxdiff(mod.weight.grad, row_block(w.grad, g))
    out["row dbias"] = _maxdiff(mod.bias.grad, bias.grad)
    for norm in ("RMSNorm", "LayerNorm"):
        config.normalization = norm
        x = torch.randn(s, b, h, generator=gen, requires_grad=True)
        weight = torch.randn(h, generator=gen, requires_grad=True)
        nbias = torch.randn(h, generator=gen, requires_grad=True)
        gout = torch.randn(s, b, h, generator=gen)
        if norm == "RMSNorm":
            dense = rms_norm_reference(x, weight, 1e-5)
        else:
            dense = torch.nn.functional.layer_norm(x, (h,), weight, nbias, 1e-5)
        (dense * gout).sum().backward()
        mod = Tp2dNorm(config, h, eps=1e-5, tp_x=2, tp_y=2, tp_group=dist.group.WORLD)
        with torch.no_grad():
            mod.weight.copy_(weight.detach())
            if mod.bias is not None:
                mod.bias.copy_(nbias.detach())
        x2 = x.detach().clone().requires_grad_()
        full = exit_2d(mod(enter_2d(x2, g)), g)
        full.backward(gout)
        out[f"{norm} out"] = _maxdiff(full, dense.detach())
        out[f"{norm} dx"] = _maxdiff(x2.grad, x.grad)
        out[f"{norm} dw"] = _maxdiff(mod.weight.grad, weight.grad)
        if mod.bias is not None:
            out[f"{norm} dbias"] = _maxdiff(mod.bias.grad, nbias.grad)
    return out


def _sharded(gpt: Any) -> dict[str, torch.Tensor]:
    """megatron's sharded state (distributed checkpoints): key -> this rank's data."""
    out: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif torch.is_tensor(getattr(value, "data", None)) and hasattr(value, "key"):
            out[value.key] = value.data.detach().clone()

    walk(gpt.sharded_state_dict())
    return out


def _model() -> Any:
    from mindspeed.testing.megatron import TinyGPTConfig

    # 8 heads in 4 query groups: divisible by TP4 (megatron needs groups % tp == 0).
    return TinyGPTConfig(num_layers=LAYERS, num_attention_heads=8, num_query_groups=4)


def _train(
    tp: int, tp2d: bool, start: dict[str, torch.Tensor] | None = None, sharded: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.config import ParallelSizes
    from mindspeed.megatron.tp2d import (
        Tp2dColumnParallelLinear,
        Tp2dRowParallelLinear,
        _shard_1d,
        apply_tp2d,
        column_block,
        install_tp2d_boundaries,
        load_1d_state_into_tp2d,
        row_block,
        tp2d_to_1d_state,
    )
    from mindspeed.testing.megatron import (
        build_gpt,
        destroy_parallel,
        global_loss,
        init_parallel,
        local_grad,
        make_batches,
        run_forward_backward,
        train_step,
        unwrap,
    )

    model = _model()
    sizes = ParallelSizes(tp=tp)
    init_parallel(sizes, model.seed)
    try:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if tp2d:
            spec = apply_tp2d(spec, 2, 2)
        chunks = build_gpt(model, sizes, layer_spec=spec)
        gpts = [unwrap(c) for c in chunks]
        result: dict[str, Any] = {}
        if tp2d:
            result["boundaries"] = install_tp2d_boundaries(chunks)
            mine = _sharded(gpts[0])
            result["sharded"] = (len(mine), sorted(set(mine) ^ set(sharded)))
            result["init_equals_1d"] = {
                k: _maxdiff(v, start[k]) for k, v in tp2d_to_1d_state(gpts).items() if k in start
            }
            with torch.no_grad():  # start from noise, then load the 1D checkpoint
                for p in gpts[0].parameters():
                    p.normal_()
            load_1d_state_into_tp2d(gpts, start)
            exported = tp2d_to_1d_state(gpts)
            result["load_roundtrip"] = [k for k, v in exported.items() if k in start and not torch.equal(v, start[k])]
        else:
            result["sharded0"] = _sharded(gpts[0]) if tp > 1 else None
            result["state0"] = {k: v.detach().clone() for k, v in gpts[0].state_dict().items() if torch.is_tensor(v)}
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), chunks)
        batches = make_batches(model, 2, 2)  # the same full batch on every rank (TP1: identical DP replicas)
        optimizer.zero_grad()
        losses = [global_loss(run_forward_backward(chunks, batches))]
        grads = {}
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        for name, module in gpts[0].named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                grads[f"{name}.{leaf}"] = (module, leaf, local_grad(param).detach().clone())
        with torch.no_grad():
            assert optimizer.step()[0], "the optimizer skipped the first step"
        losses += [train_step(chunks, optimizer, batches)[0] for _ in range(STEPS - 1)]
        result["losses"] = losses
        if tp == 1:
            result["grads"] = {k: g for k, (_, _, g) in grads.items()}
            return result
        result["grads"] = grads
        result["tp_rank"] = tp_rank
        result["final"] = (
            tp2d_to_1d_state(gpts)
            if tp2d
            else {k: v.detach().clone() for k, v in gpts[0].state_dict().items() if torch.is_tensor(v)}
        )
        result["cut"] = lambda full, module, leaf: (
            column_block(full, module.tp2d, module.stride)
            if isinstance(module, Tp2dColumnParallelLinear) and leaf == "weight"
            else row_block(full, module.tp2d)
            if isinstance(module, Tp2dRowParallelLinear) and leaf == "weight"
            else _shard_1d(
                full,
                tp_rank,
                tp,
                getattr(module.get_parameter(leaf), "partition_stride", 1),
                getattr(module.get_parameter(leaf), "partition_dim", 0),
            )
            if getattr(module.get_parameter(leaf), "tensor_model_parallel", False)
            else full
        )
        return result
    finally:
        destroy_parallel()


def _train_grid(grid: tuple[int, int] | None, pp: int, sequence_parallel: bool = False) -> dict[str, Any]:
    """The tiny GPT, 3 Adam steps, at PP ``pp`` x TP ``tp_x * tp_y`` (1D TP2 for ``grid=None``).

    Each pipeline stage's chunk enters the 2D layout at its first layer and leaves it after its
    last, so the pipeline messages are megatron's ``[s, b, h]`` (``[s / tp, b, h]`` with SP).
    PP1 runs the one-rank run's batches; PP2 four microbatches (1F1B's steady state runs).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.megatron.config import ParallelSizes
    from mindspeed.megatron.tp2d import apply_tp2d, install_tp2d_boundaries
    from mindspeed.testing.megatron import build_gpt, destroy_parallel, init_parallel, make_batches, train_step, unwrap

    model = _model()
    sizes = ParallelSizes(tp=grid[0] * grid[1] if grid else 2, pp=pp)
    init_parallel(sizes, model.seed)
    try:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if grid is not None:
            spec = apply_tp2d(spec, *grid)
        chunks = build_gpt(model, sizes, layer_spec=spec, sequence_parallel=sequence_parallel)
        entering: list[int] = []  # the sequence length the chunk's first layer receives (before the 2D entry)
        unwrap(chunks[0]).decoder.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: entering.append(kwargs.get("hidden_states", args and args[0]).shape[0]),
            with_kwargs=True,
        )
        boundaries = install_tp2d_boundaries(chunks) if grid is not None else 0
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), chunks)
        batches = make_batches(model, 2, 4 if pp > 1 else 2)
        steps = [train_step(chunks, optimizer, batches) for _ in range(STEPS)]
        return {
            "losses": [loss for loss, _ in steps],
            "norms": [norm for _, norm in steps],
            "boundaries": boundaries,
            "entering": sorted(set(entering)),
            "seq": batches[0]["tokens"].shape[1] // (sizes.tp if sequence_parallel else 1),
        }
    finally:
        destroy_parallel()


#: The runs of :func:`_train_grid` in the 4-rank group: (grid, pp, sequence parallel).
GRID_RUNS = {
    "pp2 1d": (None, 2, False),
    "pp2 2x1": ((2, 1), 2, False),
    "pp2 1x2": ((1, 2), 2, False),
    "pp2 1x2 sp": ((1, 2), 2, True),
    "2x2 sp": ((2, 2), 1, True),
}


def _pretrain(tp2d: bool, save: str | None = None, steps: int = STEPS) -> dict[str, Any]:
    """The LLM pretrain recipe at TP4, 1D or with the ``tp_2d`` feature (2x2); ``save``: checkpoints
    there every 2 steps (and resume from the newest)."""
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    config = load_pretrain_config(
        None,
        [
            "data.mock=true",
            "data.seq_length=32",
            "model.vocab_size=128",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=8",
            "model.num_query_groups=4",
            "model.ffn_hidden_size=128",
            "parallel.tp=4",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            f"train.steps={steps}",
            "train.lr=1e-3",
            "train.lr_decay_style=constant",
            "logging.progress=false",
        ],
    )
    config.features.optimization_level = 0
    if save is not None:
        config.checkpoint.save, config.checkpoint.interval = save, 2
    if tp2d:
        config.features.settings = {"tp_2d": {"enabled": True, "tp_x": 2, "tp_y": 2}}
    result = pretrain(config)
    on = [f["name"] for f in (result.features or {}).get("features", []) if f.get("enabled")]
    return {"losses": [r["loss"] for r in result.records], "steps": [r["step"] for r in result.records], "on": on}


def _resume_chain(root: str) -> dict[str, Any]:
    """Checkpoints across layouts: 1D TP4 trains 4 steps (saving at 2 and 4); 2D resumes from
    1D's step 2 and saves step 3; 1D resumes from 2D's step 3 for step 4 (megatron's distributed
    checkpoints, optimizer state included)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    def copy(src: str, dst: str, step: int) -> None:
        if dist.get_rank() == 0:
            keep = f"iter_{step:07d}"
            shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("iter_") and n != keep])
        dist.barrier()

    one_d = _pretrain(False, save=f"{root}/1d", steps=4)
    copy(f"{root}/1d", f"{root}/2d", 2)
    two_d = _pretrain(True, save=f"{root}/2d", steps=3)
    copy(f"{root}/2d", f"{root}/back", 3)
    back = _pretrain(False, save=f"{root}/back", steps=4)
    return {"1d": one_d, "2d": two_d, "back": back, "dirs": sorted(p.name for p in Path(f"{root}/2d").iterdir())}


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed.megatron import adapt, unadapt

    out: dict[str, Any] = {"units": _units()}
    adapt("cpu")
    try:
        one = _train(1, False)
        tp1d = _train(4, False)
        tp2d = _train(4, True, start=tp1d["state0"], sharded=tp1d["sharded0"])
        out["grids"] = {name: _train_grid(*args) for name, args in GRID_RUNS.items()}
    finally:
        unadapt()
    out["losses"] = {"one": one["losses"], "1d": tp1d["losses"], "2d": tp2d["losses"]}
    out["resume"] = _resume_chain(root)
    out["boundaries"] = tp2d["boundaries"]
    out["sharded"] = tp2d["sharded"]
    out["init_equals_1d"] = max(tp2d["init_equals_1d"].values())
    out["init_keys"] = len(tp2d["init_equals_1d"])
    out["load_roundtrip"] = tp2d["load_roundtrip"]
    for label, run in (("1d", tp1d), ("2d", tp2d)):
        diffs = {}
        for name, (module, leaf, grad) in run["grads"].items():
            diffs[name] = _maxdiff(grad, run["cut"](one["grads"][name], module, leaf))
        out[f"grads {label}"] = diffs
    out["final"] = {k: _maxdiff(v, tp1d["final"][k]) for k, v in tp2d["final"].items() if k in tp1d["final"]}
    return out


@pytest.mark.distributed
def test_tp2d_2x2_equals_tp4_and_one_rank(tmp_path: Any) -> None:
    for rank, out in enumerate(run_distributed(_group, 4, str(tmp_path), timeout=400)):
        bad_units = {k: v for k, v in out["units"].items() if v > 1e-5}
        assert not bad_units, f"rank {rank}: 2D ops differ from the dense ops: {bad_units}"
        losses = out["losses"]
        for label in ("1d", "2d"):
            for step, (a, b) in enumerate(zip(losses["one"], losses[label])):
                assert abs(a - b) <= TOL, f"rank {rank} {label} step {step}: loss {b} != one rank's {a}"
        assert out["boundaries"] == 1
        chain = out["resume"]
        assert chain["1d"]["on"] == [] and chain["2d"]["on"] == ["tp_2d"], chain
        assert chain["2d"]["steps"] == [3] and chain["back"]["steps"] == [4], chain
        expected = chain["1d"]["losses"]
        got = {3: chain["2d"]["losses"][0], 4: chain["back"]["losses"][0]}
        for step, loss in got.items():
            assert abs(loss - expected[step - 1]) <= TOL, f"rank {rank} step {step}: {loss} != 1D's {expected}"
        assert out["init_keys"] > 10 and out["init_equals_1d"] == 0.0, out["init_equals_1d"]
        assert out["load_roundtrip"] == []
        count, unmatched = out["sharded"]
        assert count >= 8 and unmatched == [], f"rank {rank}: distributed-checkpoint keys != 1D's: {unmatched}"
        for label in ("1d", "2d"):
            diffs = out[f"grads {label}"]
            assert len(diffs) >= 12
            bad = {k: v for k, v in diffs.items() if v > TOL}
            assert not bad, f"rank {rank} {label}: gradients differ from one rank's: {bad}"
        bad = {k: v for k, v in out["final"].items() if v > WEIGHT_TOL}
        assert len(out["final"]) >= 12 and not bad, f"rank {rank}: 2D weights after {STEPS} steps differ from 1D: {bad}"
        # PP2 x TP2: the 2D grids 2x1 and 1x2 (each axis alone; with SP too) train as 1D TP2 at PP2;
        # 2x2 with SP (chunk input and output [s / tp, b, h]) as one rank.
        grids = out["grids"]
        assert [grids[name]["boundaries"] for name in GRID_RUNS] == [0, 1, 1, 1, 1], grids
        # SP ran: the chunk's first layer received s / tp rows (s without SP).
        assert all(grids[name]["entering"] == [grids[name]["seq"]] for name in GRID_RUNS), grids
        assert grids["2x2 sp"]["seq"] < grids["pp2 1x2"]["seq"]
        reference = grids["pp2 1d"]
        assert reference["losses"][-1] < reference["losses"][0], "PP2 did not learn: the check would be vacuous"
        for name in ("pp2 2x1", "pp2 1x2", "pp2 1x2 sp"):
            for step in range(STEPS):
                assert abs(grids[name]["losses"][step] - reference["losses"][step]) <= TOL, (rank, name, step, grids)
                assert grids[name]["norms"][step] == pytest.approx(reference["norms"][step], rel=1e-6), (rank, name)
        for step, (a, b) in enumerate(zip(losses["one"], grids["2x2 sp"]["losses"])):
            assert abs(a - b) <= TOL, f"rank {rank} 2x2 + SP step {step}: loss {b} != one rank's {a}"


def test_tp2d_feature_refusals() -> None:
    from mindspeed.features import FEATURES, BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features

    def run(parallel: ParallelSizes, tp_x: int = 2, tp_y: int = 2, **facts: Any) -> Any:
        ctx = BuildContext("cpu", parallel, ModelFacts(**facts))
        settings = {"tp_2d": {"enabled": True, "tp_x": tp_x, "tp_y": tp_y}}
        return apply_features(FeaturesConfig(optimization_level=0, settings=settings), ctx), ctx

    report, ctx = run(ParallelSizes(tp=4), num_moe_experts=0)
    assert dict(ctx.config_overrides) == {"tp_x": 2, "tp_y": 2}
    # PP and SP compose (proven at PP2 x 2x1 / 1x2 and 2x2 + SP above).
    run(ParallelSizes(tp=4, pp=2), num_moe_experts=0, extra={"sequence_parallel": True})
    assert "tp_2d" in FEATURES.keys()
    for parallel, kwargs, words in (
        (ParallelSizes(tp=4), {"tp_x": 4, "tp_y": 1}, "both > 1"),
        (ParallelSizes(tp=8), {}, "must equal parallel.tp=8"),
        (ParallelSizes(tp=4), {"num_moe_experts": 4}, "experts"),
        (ParallelSizes(tp=4, cp=2), {}, "cp=2"),
    ):
        with pytest.raises(ValueError, match=words) as error:
            run(parallel, **kwargs)
        assert "\n" not in str(error.value) and "tp_2d" in str(error.value)
    with pytest.raises(ValueError, match="coc"):
        ctx = BuildContext("cpu", ParallelSizes(tp=4), ModelFacts(extra={"sequence_parallel": False}))
        settings = {"tp_2d": {"enabled": True, "tp_x": 2, "tp_y": 2}, "coc": True}
        apply_features(FeaturesConfig(optimization_level=0, settings=settings), ctx)
