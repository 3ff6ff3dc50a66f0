"""Wan2.2's two experts (``diffusion.expert``) against diffusers, on a tiny ``WanPipeline`` saved in code.

- The experts' ranges of the grid are ``WanPipeline``'s switch: ``high_noise`` holds exactly the
  grid timesteps ``t >= boundary_ratio x 1000``; 3000 uniform draws of each expert stay in its range and
  reach both of its ends; ``boundary_ratio`` comes from the pipeline's ``model_index.json``.
- A training microbatch's loss and every parameter's gradient equal a reference computed with
  separately loaded diffusers ``WanTransformer3DModel`` experts, each sample's timestep routed by
  hand (``t >= boundary``: ``transformer``, else ``transformer_2``): the high-noise expert alone,
  the low-noise one alone, and both in one run (samples of a microbatch on both sides).
- ``both`` under FSDP2 DP2 (one sample per rank, so each rank leaves one expert idle every microbatch)
  equals DP1 accumulating the same microbatches, and ``checkpoint.save_hf`` writes ``transformer/``,
  ``transformer_2/`` and ``model_index.json`` that diffusers' ``WanPipeline.from_pretrained`` loads
  with no missing keys, holding the trained weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import ConfigError, DiffusionConfig, load_mm_config
from mindspeed_mm.diffusion import FlowMatching
from mindspeed_mm.models.dit import DIT_FAMILIES
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.loop import train
from mindspeed_mm.trainer.task import TASKS

WAN = "WanTransformer3DModel"
TEXT_LEN = 8
RATIO = 0.875
STEPS = 2


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A tiny Wan2.2 pipeline directory (two experts of different weights, boundary_ratio 0.875) and features."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    root = tmp_path_factory.mktemp("wan22")
    _, features = write_tiny_dit_run(root / "data", WAN, num_samples=8)
    family = DIT_FAMILIES.get(WAN)
    experts = []
    for seed in (0, 7):
        torch.manual_seed(seed)
        experts.append(family.load_class()(**family.tiny_config))
    scheduler = UniPCMultistepScheduler(**family.scheduler[1])
    WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
        scheduler=scheduler,
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=RATIO,
    ).save_pretrained(root / "pipe")
    return root / "pipe", features


def _overrides(model_dir, features, **extra) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        f"data.text_len={TEXT_LEN}",
        "data.shuffle=false",
        "train.precision=fp32",
        "logging.progress=false",
        "diffusion.shift=5.0",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


#: (expert, model folder, diffusion keys, micro batch)
CASES = [
    ("high_noise", "transformer", {"timestep_per": "microbatch", "loss_weighting": "bsmntw"}, 2),
    ("low_noise", "transformer_2", {"timestep_sampling": "logit_normal", "loss_weighting": "sigma_sqrt"}, 3),
    ("both", "transformer", {"loss_weighting": "none", "text_dropout": 0.3}, 4),
]


def _reference(
    pipe, task, batch, expert: str, factors: dict[str, torch.Tensor] | None = None
) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    """Loss and gradients with diffusers' experts, each sample routed by hand; the experts each sample went to.

    With ``factors`` (a LoRA run's, under the pair's names) each expert gets diffusers' own ``add_adapter`` on the
    family's targets holding them, and only the factors' gradients are returned."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from diffusers.training_utils import compute_loss_weighting_for_sd3
    from peft import LoraConfig

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    indices, latents, noise = batch.draw.indices, batch.latents, batch.draw.noise
    timesteps = scheduler.timesteps[indices]
    # The grid is diffusers' to within one float32 ulp (test_dit: rtol 1e-6); an ulp of the timestep moves
    # the time embedder's gradients by 6e-5, so the model is given the task's grid values, and the routing
    # is checked against the scheduler's own timesteps too.
    sigmas = task.flow.sigmas[indices]
    torch.testing.assert_close(sigmas, scheduler.sigmas[indices], rtol=1e-6, atol=0)
    model_timesteps = sigmas * 1000.0
    shaped = sigmas.reshape(-1, 1, 1, 1, 1)
    noisy = (1.0 - shaped) * latents + shaped * noise  # as diffusers' flow-matching training scripts write it
    text, _ = task.model_text(batch)
    models = {name: WanTransformer3DModel.from_pretrained(pipe / name) for name in ("transformer", "transformer_2")}
    if factors is not None:
        lora = task.config.lora
        targets = list(DIT_FAMILIES.get(WAN).lora_targets)
        for name, model in models.items():
            model.add_adapter(LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=targets))
            own = {k[len(name) + 1 :]: v for k, v in factors.items() if k.startswith(name + ".")}
            assert own and set(own) == {n for n, p in model.named_parameters() if p.requires_grad}, name
            model.load_state_dict(own, strict=False)
    routed = ["transformer" if t >= RATIO * 1000 else "transformer_2" for t in timesteps.tolist()]
    assert routed == ["transformer" if t >= RATIO * 1000 else "transformer_2" for t in model_timesteps.tolist()]
    pred = torch.zeros_like(latents)
    for name, model in models.items():  # each expert on its samples, as one batch
        rows = [i for i, expert_name in enumerate(routed) if expert_name == name]
        if rows:
            pred[rows] = model(noisy[rows], model_timesteps[rows], text[rows]).sample
    scheme = task.config.diffusion.loss_weighting
    if scheme == "bsmntw":  # MindSpeed-MM's WanFlowMatchScheduler.training_weight
        y = torch.exp(-2 * ((scheduler.timesteps - 500) / 1000) ** 2)
        weighting = ((y - y.min()) * (1000 / (y - y.min()).sum()))[indices]
    else:
        weighting = compute_loss_weighting_for_sd3(scheme, sigmas) * torch.ones(len(routed))
    error = (pred.float() - (noise - latents).float()) ** 2
    loss = (weighting.reshape(-1, 1) * error.reshape(len(routed), -1)).mean(1).mean()
    loss.backward()
    grads = {}
    for name, model in models.items():
        if expert == "both":
            grads.update({f"{name}.{n}": p.grad for n, p in model.named_parameters() if p.requires_grad})
        elif name == task.source.name:
            grads.update({n: p.grad for n, p in model.named_parameters()})
    return float(loss.detach()), grads, routed


def _parity(pipe, features) -> dict:
    results = {}
    for expert, folder, diffusion, micro in CASES:
        config = load_mm_config(
            None,
            _overrides(pipe / folder, features, **{"train.micro_batch_size": micro, "diffusion.expert": expert})
            + [f"diffusion.{k}={v}" for k, v in diffusion.items()],
        )
        task = TASKS.get("dit")(config, 1)
        batch = task.microbatches(1, 0)[0]
        loss, _ = task.loss(batch, torch.zeros(2))
        loss.backward()
        ours = {n: p.grad for n, p in task.model.named_parameters()}
        expected, grads, routed = _reference(pipe, task, batch, expert)
        error = max(float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items())
        # 3000 draws of the expert's timesteps: the recipe's, and uniform ones over the same range
        uniform = FlowMatching(DiffusionConfig(shift=5.0))
        uniform.index_range = task.flow.index_range
        draws = {
            name: torch.cat([flow.draw(flow.generator(5, k), (1, 1)).indices for k in range(3000)]).tolist()
            for name, flow in (("recipe", task.flow), ("uniform", uniform))
        }
        results[expert] = {
            "loss": float(loss.detach()),
            "expected": expected,
            "grad_error": error,
            "names": set(ours) == set(grads),
            "routed": routed,
            "index_range": task.flow.index_range,
            "draws": {name: (min(d), max(d)) for name, d in draws.items()},
            "timesteps": task.flow.timesteps,
        }
    # bf16 (FSDP2 wraps the pair on one rank): the loss stays near fp32's and the experts get float32 timesteps
    bf16 = {}
    for precision in ("fp32", "bf16"):
        config = load_mm_config(
            None,
            _overrides(
                pipe / "transformer",
                features,
                **{"train.micro_batch_size": 4, "diffusion.expert": "both", "train.precision": precision},
            ),
        )
        task = TASKS.get("dit")(config, 1)
        seen = []
        for expert in (task.model.transformer, task.model.transformer_2):
            expert.condition_embedder.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        loss = task.loss(task.microbatches(1, 0)[0], torch.zeros(2))[0]
        loss.backward()
        bf16[precision] = (float(loss.detach()), type(task.model).__name__, seen)
    results["bf16"] = bf16
    # LoRA on both experts (r 4, alpha 8, the family's targets): the factors' gradients against diffusers'
    # add_adapter on each expert holding the same factors (lora_B drawn too, so lora_A gets a gradient)
    config = load_mm_config(
        None,
        _overrides(pipe / "transformer", features, **{"train.micro_batch_size": 4, "diffusion.expert": "both"})
        + ["lora.target_modules=[default]", "lora.r=4", "lora.alpha=8", "diffusion.text_dropout=0.3"],
    )
    task = TASKS.get("dit")(config, 1)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in task.model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    factors = {n: p.detach().clone() for n, p in task.model.named_parameters() if p.requires_grad}
    batch = task.microbatches(1, 0)[0]
    loss, _ = task.loss(batch, torch.zeros(2))
    loss.backward()
    ours = {n: p.grad for n, p in task.model.named_parameters() if p.requires_grad}
    expected, grads, routed = _reference(pipe, task, batch, "both", factors)
    results["both_lora"] = {
        "loss": float(loss.detach()),
        "expected": expected,
        "grad_error": max(float((ours[n] - g).abs().max() / g.abs().max()) for n, g in grads.items()),
        "names": set(ours) == set(grads),
        "factors": len(ours),
        "experts": {name.split(".", 1)[0] for name in ours},
        "routed": routed,
    }
    return results


def test_expert_routing_loss_and_gradients_equal_diffusers(pipeline) -> None:
    pipe, features = pipeline
    results = launch(_parity, (pipe, features))
    timesteps = results["high_noise"]["timesteps"]
    high = int((timesteps >= RATIO * 1000).sum())
    assert timesteps[high - 1] >= RATIO * 1000 > timesteps[high]  # WanPipeline's switch on the grid
    from diffusers import FlowMatchEulerDiscreteScheduler

    theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0).timesteps
    assert int((theirs >= RATIO * 1000).sum()) == high  # the scheduler's own timesteps split there too
    assert results["high_noise"]["index_range"] == (0, high) and results["low_noise"]["index_range"] == (high, 1000)
    for expert, (lo, hi) in (("high_noise", (0, high - 1)), ("low_noise", (high, 999))):
        draws = results[expert]["draws"]
        assert draws["uniform"] == (lo, hi), expert  # in range, both ends reached
        assert lo <= draws["recipe"][0] <= draws["recipe"][1] <= hi, expert
    assert results["both"]["index_range"] is None
    for expert, *_ in CASES:
        result = results[expert]
        assert result["names"], expert
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), expert
        assert result["grad_error"] < 1e-5, (expert, result["grad_error"])
        print(
            f"{expert}: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative gradient "
            f"error {result['grad_error']:.1e}, experts {result['routed']}"
        )
    assert set(results["high_noise"]["routed"]) == {"transformer"}
    assert set(results["low_noise"]["routed"]) == {"transformer_2"}
    assert set(results["both"]["routed"]) == {"transformer", "transformer_2"}  # one microbatch on both sides
    lora = results["both_lora"]
    print(
        f"both, LoRA: loss {lora['loss']:.6f} (diffusers add_adapter {lora['expected']:.6f}), max relative gradient "
        f"error {lora['grad_error']:.1e} over {lora['factors']} factors, experts {lora['routed']}"
    )
    assert lora["names"] and lora["experts"] == {"transformer", "transformer_2"}
    assert set(lora["routed"]) == {"transformer", "transformer_2"}
    assert lora["loss"] == pytest.approx(lora["expected"], rel=1e-6) and lora["grad_error"] < 1e-5
    (fp32, _, _), (half, sharded, dtypes) = results["bf16"]["fp32"], results["bf16"]["bf16"]
    print(f"both: fp32 loss {fp32:.6f}, bf16 (FSDP2) {half:.6f}")
    assert half == pytest.approx(fp32, rel=2e-2) and half != fp32 and sharded == "FSDPExpertPair"
    assert dtypes == [torch.float32, torch.float32]


#: LoRA on both experts (r 4, alpha 8, the family's targets), 2 steps of one microbatch of 2 samples
LORA = {
    "diffusion.expert": "both",
    "lora.target_modules": "[default]",
    "lora.r": 4,
    "lora.alpha": 8,
    "train.steps": STEPS,
    "train.micro_batch_size": 2,
    "train.lr": 1e-2,
}


def _train_lora(pipe, features, root, name: str, **extra) -> list[dict]:
    paths = {"lora.save_peft": root / name / "lora", "checkpoint.save_hf": root / name / "merged"}
    overrides = _overrides(pipe / "transformer", features, **LORA, **paths, **extra)
    overrides.append(f"checkpoint.save={root / name / 'dcp'}")
    return train(load_mm_config(None, overrides)).records


def _runs(pipe, features, root, world: int) -> dict:
    """``both`` in full (DP2 or DP1 accumulating), then with LoRA (SP2 under Ulysses, or SP1); the LoRA run's
    sequence-parallel attention calls."""
    import mindspeed_mm.trainer.dit_task as dit_task

    full = _train_both(pipe, features, root, 3 - world, f"dp{world}")
    seen, original = {}, dit_task.apply_sequence_parallel
    dit_task.apply_sequence_parallel = lambda *args, **kwargs: seen.setdefault("sp", original(*args, **kwargs))
    try:
        extra = {"parallel.ulysses_parallel_size": 2} if world == 2 else {}
        lora = _train_lora(pipe, features, root, f"sp{world}", **extra)
    finally:
        dit_task.apply_sequence_parallel = original
    return {"full": full, "lora": lora, "calls": seen["sp"].calls if "sp" in seen else 0}


def _train_both(pipe, features, root, accumulation: int, name: str) -> list[dict]:
    overrides = _overrides(
        pipe / "transformer",
        features,
        **{
            "diffusion.expert": "both",
            "diffusion.timestep_per": "microbatch",
            "train.steps": STEPS,
            "train.micro_batch_size": 1,
            "train.gradient_accumulation_steps": accumulation,
            "train.lr": 1e-3,
            "data.shuffle": "true",
            "checkpoint.save_hf": str(root / name),
            "checkpoint.save": str(root / f"{name}-dcp"),
        },
    )
    records = train(load_mm_config(None, overrides)).records
    return records


def test_both_experts_dp2_equals_dp1_and_pipeline_export(pipeline, tmp_path) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe, features = pipeline
    ranks2 = launch(_runs, (pipe, features, tmp_path, 2), nproc_per_node=2)
    ranks1 = launch(_runs, (pipe, features, tmp_path, 1))
    dp2, dp1 = ranks2["full"], ranks1["full"]
    assert [r["step"] for r in dp1] == [r["step"] for r in dp2] == list(range(1, STEPS + 1))
    for one, two in zip(dp1, dp2, strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["step"]
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), one["step"]
        print(
            f"step {one['step']}: loss DP1 {one['loss']:.6f} DP2 {two['loss']:.6f}, grad norm {one['grad_norm']:.6f} {two['grad_norm']:.6f}"
        )

    export = tmp_path / "dp2"
    assert json.loads((export / "model_index.json").read_text())["boundary_ratio"] == RATIO
    for folder in ("transformer", "transformer_2"):
        loaded, info = WanTransformer3DModel.from_pretrained(export / folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        before = WanTransformer3DModel.from_pretrained(pipe / folder).state_dict()
        dp1_weights = WanTransformer3DModel.from_pretrained(tmp_path / "dp1" / folder).state_dict()
        weights = loaded.state_dict()
        assert any(not torch.equal(before[n], w) for n, w in weights.items()), folder  # it trained
        for n, w in weights.items():
            torch.testing.assert_close(w, dp1_weights[n], rtol=1e-4, atol=1e-6)
    # `convert` of DP1's last DCP checkpoint (dcp -> hf, --base-dir: the run's model.path) writes the same pair
    from mindspeed_mm.convert.config import ConvertConfig
    from mindspeed_mm.convert.convert import convert

    converted = tmp_path / "converted"
    report = convert(
        ConvertConfig(
            load_format="dcp",
            save_format="hf",
            load_dir=tmp_path / "dp1-dcp",
            save_dir=converted,
            base_dir=pipe / "transformer",
            progress=False,
        )
    )
    print(report.describe())
    assert json.loads((converted / "model_index.json").read_text())["boundary_ratio"] == RATIO
    for folder in ("transformer", "transformer_2"):
        loaded, info = WanTransformer3DModel.from_pretrained(converted / folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        exported = WanTransformer3DModel.from_pretrained(tmp_path / "dp1" / folder).state_dict()
        assert all(torch.equal(w, exported[n]) for n, w in loaded.state_dict().items()), folder
    with pytest.raises(ValueError, match="holds a Wan2.2 expert pair"):
        convert(
            ConvertConfig(
                load_format="dcp",
                save_format="hf",
                load_dir=tmp_path / "dp1-dcp",
                save_dir=tmp_path / "wrong",
                base_dir=pipe / "transformer_2",
                progress=False,
            )
        )
    for folder in ("vae", "scheduler"):  # the pipeline's other parts, copied beside the experts
        shutil.copytree(pipe / folder, export / folder)
    loaded = WanPipeline.from_pretrained(export, tokenizer=None, text_encoder=None)
    assert loaded.config.boundary_ratio == RATIO and loaded.transformer_2 is not None
    # SP2's attention went through Ulysses: the self-attention of both experts' 2 blocks, 2 steps
    assert ranks2["calls"] == 2 * 2 * STEPS and ranks1["calls"] == 0
    _check_lora(pipe, tmp_path, ranks1["lora"], ranks2["lora"])


def _check_lora(pipe, root, sp1: list[dict], sp2: list[dict]) -> None:
    """LoRA on both experts: SP2 (Ulysses) = SP1; each expert's diffusers LoRA loads into WanPipeline
    (``load_into_transformer_2`` for the second) and gives the merged export's output; ``generate``'s loader of the
    DCP checkpoint gives the pair that ``convert`` writes."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from mindspeed_mm.convert.config import ConvertConfig
    from mindspeed_mm.convert.convert import convert
    from mindspeed_mm.inference.dit_pipeline import load_dit_pipeline, load_second_expert

    for one, two in zip(sp1, sp2, strict=True):
        print(
            f"LoRA step {one['step']}: loss SP1 {one['loss']:.6f} SP2 {two['loss']:.6f}, "
            f"grad norm {one['grad_norm']:.6f} {two['grad_norm']:.6f}"
        )
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["step"]
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), one["step"]
    family = DIT_FAMILIES.get(WAN)
    gen = torch.Generator().manual_seed(3)
    inputs = family.model_inputs(
        family.load_class().load_config(pipe / "transformer"),
        torch.randn(2, 4, 3, 4, 4, generator=gen),
        torch.tensor([0.3, 0.9]),
        torch.randn(2, TEXT_LEN, 16, generator=gen),
        None,
        1.0,
    )

    def output(model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(**inputs)[0]

    adapted = WanPipeline.from_pretrained(pipe, tokenizer=None, text_encoder=None)
    adapted.load_lora_weights(str(root / "sp2" / "lora" / "transformer"))
    adapted.load_lora_weights(str(root / "sp2" / "lora" / "transformer_2"), load_into_transformer_2=True)
    for folder, model in (("transformer", adapted.transformer), ("transformer_2", adapted.transformer_2)):
        merged = {
            run: output(WanTransformer3DModel.from_pretrained(root / run / "merged" / folder)) for run in ("sp1", "sp2")
        }
        base = output(WanTransformer3DModel.from_pretrained(pipe / folder))
        lora = output(model)
        print(
            f"{folder}: |load_lora_weights - merged| {float((lora - merged['sp2']).abs().max()):.2e}, "
            f"|SP2 - SP1| {float((merged['sp2'] - merged['sp1']).abs().max()):.2e}, "
            f"|merged - base| {float((merged['sp2'] - base).abs().max()):.2e}"
        )
        torch.testing.assert_close(lora, merged["sp2"], rtol=0, atol=1e-5)
        torch.testing.assert_close(merged["sp2"], merged["sp1"], rtol=0, atol=1e-5)
        assert float((merged["sp2"] - base).abs().max()) > 1e-3, folder  # the adapters trained
    # generate --load-dir of the pair's DCP checkpoint (LoRA merged) = generate of its conversion
    checkpoint = root / "sp2" / "dcp"
    convert(
        ConvertConfig(
            load_format="dcp",
            save_format="hf",
            load_dir=checkpoint,
            save_dir=root / "sp2" / "converted",
            base_dir=pipe / "transformer",
            progress=False,
        )
    )
    loaded = load_dit_pipeline(checkpoint, base_dir=pipe / "transformer")
    second, ratio = load_second_expert(loaded, torch.float32)
    assert ratio == RATIO and loaded.pipeline_dir == pipe and "vae" in loaded.parts
    for folder, model in (("transformer", loaded.model), ("transformer_2", second)):
        converted = WanTransformer3DModel.from_pretrained(root / "sp2" / "converted" / folder).state_dict()
        state = model.state_dict()
        assert set(state) == set(converted) and all(torch.equal(v, converted[n]) for n, v in state.items()), folder


def test_expert_config_errors(pipeline, tmp_path) -> None:
    with pytest.raises(ConfigError, match="remove diffusion.min_timestep_boundary"):
        DiffusionConfig(expert="high_noise", min_timestep_boundary=0.417).check()
    with pytest.raises(ConfigError, match="boundary_ratio=1.5"):
        DiffusionConfig(expert="both", boundary_ratio=1.5).check()
    # a lone transformer directory: no model_index.json, no boundary_ratio
    pipe, features = pipeline
    shutil.copytree(pipe / "transformer", tmp_path / "alone")
    config = load_mm_config(None, _overrides(tmp_path / "alone", features, **{"diffusion.expert": "high_noise"}))
    with pytest.raises(ValueError, match="set diffusion.boundary_ratio"):
        TASKS.get("dit")(config, 1)
    # train.compile with both: the blocks of both experts (compiled lazily: nothing runs here)
    from mindspeed_mm.models.dit_compile import compile_blocks
    from mindspeed_mm.models.wan_experts import load_pair

    pair = load_pair(pipe / "transformer", DIT_FAMILIES.get(WAN), RATIO * 1000, meta=True)
    compiled = compile_blocks(pair, True)
    assert compiled == [f"{folder}.blocks.{i}" for folder in ("transformer", "transformer_2") for i in (0, 1)]
    flow = FlowMatching(DiffusionConfig(shift=5.0))
    with pytest.raises(ValueError, match="leaves the low_noise expert no timestep"):
        flow.expert_range("low_noise", 0.001)  # the grid's smallest timestep is 4.98
