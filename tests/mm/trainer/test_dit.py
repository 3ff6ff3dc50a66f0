"""The diffusion-transformer task against diffusers: grid, draws, noising, model call, target, weights, loss.

- The timestep grid equals ``FlowMatchEulerDiscreteScheduler``'s training sigmas and timesteps
  for several shifts; the draws of ``u`` equal diffusers' ``compute_density_for_timestep_sampling``
  with the same generator; the weights equal ``compute_loss_weighting_for_sd3`` and MindSpeed-MM's
  bsmntw formula.
- A training microbatch's loss and every parameter's gradient equal a reference computed with a
  separately loaded diffusers model as diffusers' training scripts write it (the scheduler's
  ``scale_noise``, ``WanPipeline``'s zero padding of the text, ``FluxPipeline``'s packing and
  image ids, ``noise - x0``), on the same latents, noise and timesteps: Wan with MindSpeed-MM's
  recipe (shift 5, one uniform timestep per microbatch, bsmntw) and with diffusers' (logit-normal
  per sample, sigma_sqrt, text dropout), FLUX with guidance and text dropout.
- Under bf16 (FSDP2's policy) the loss stays within 2% of fp32's for Wan and FLUX, the backward
  runs, and the timestep reaches the model in float32.
- Buckets: every microbatch of a cache of two latent shapes is of one shape; DP2 sees the
  microbatches DP1 accumulates; no sample twice in an epoch.
- FSDP2 DP2 (one microbatch per rank) equals DP1 (two accumulated microbatches) over 3 steps;
  ``checkpoint.save_hf`` writes a diffusers directory that ``from_pretrained`` loads with no missing
  or unexpected keys, holding exactly the last DCP checkpoint's weights.
- ``train.ema`` (EMA-AdamW under FSDP2 DP2): the checkpointed averages equal the moving average of
  the initial and the checkpointed weights, the export holds them, and a run resumed from step 1
  exports the same averages bit for bit.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from mindspeed.launch import launch
from mindspeed.testing.distributed import run_distributed
from mindspeed_mm.config import DiffusionConfig, load_mm_config
from mindspeed_mm.data.buckets import BucketOrder
from mindspeed_mm.diffusion import FlowMatching, sample_density, sigma_grid
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.loop import train
from mindspeed_mm.trainer.task import TASKS

TEXT_LEN = 8
#: Steps of the DP2 = DP1 comparison (and of its EMA runs).
DP_STEPS = 3
WAN, FLUX = "WanTransformer3DModel", "FluxTransformer2DModel"


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("tiny-dit")
    runs = {arch: write_tiny_dit_run(root / arch, arch) for arch in (WAN, FLUX)}
    runs["mixed"] = write_tiny_dit_run(root / "mixed", WAN, num_samples=9, latent_shapes=[(4, 3, 4, 4), (4, 2, 6, 4)])
    return runs


def test_grid_draws_and_weights_equal_diffusers() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    for shift in (1.0, 3.0, 5.0):
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        torch.testing.assert_close(sigma_grid(1000, shift), scheduler.sigmas, rtol=1e-6, atol=0)
        torch.testing.assert_close(
            FlowMatching(DiffusionConfig(shift=shift)).timesteps, scheduler.timesteps, rtol=1e-6, atol=0
        )
    for scheme in ("uniform", "logit_normal", "mode"):
        ours = sample_density(scheme, 64, torch.Generator().manual_seed(3), 0.2, 0.8, 1.29)
        theirs = compute_density_for_timestep_sampling(
            scheme, 64, 0.2, 0.8, 1.29, generator=torch.Generator().manual_seed(3)
        )
        assert torch.equal(ours, theirs), scheme
    indices = torch.tensor([0, 17, 417, 999])
    for scheme in ("sigma_sqrt", "cosmap", "none"):
        flow = FlowMatching(DiffusionConfig(shift=3.0, loss_weighting=scheme))
        expected = compute_loss_weighting_for_sd3(scheme, flow.sigmas[indices])
        torch.testing.assert_close(flow.weights(indices), expected.float() * torch.ones(4), rtol=1e-6, atol=0)
    flow = FlowMatching(DiffusionConfig(shift=5.0, loss_weighting="bsmntw"))
    assert flow.bsmntw.mean().item() == pytest.approx(1.0, rel=1e-5) and flow.bsmntw.min().item() == 0.0
    # Wan2.2's expert boundary: grid index 417 at shift 5 is sigma 0.875 (its boundary_ratio)
    assert flow.sigmas[417].item() == pytest.approx(0.875, abs=1e-3)


def _pipeline_text(features, indices, null, drop) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Text as WanPipeline / FluxPipeline give it: zero-padded to the max length, the empty caption where dropped."""

    def pad(u):
        return torch.cat([u, u.new_zeros(TEXT_LEN - u.size(0), u.size(1))])

    text = torch.stack([pad(null["text"]) if d else pad(features[i]["text"]) for i, d in zip(indices, drop)])
    if "pooled" not in null:
        return text, None
    return text, torch.stack([null["pooled"] if d else features[i]["pooled"] for i, d in zip(indices, drop)])


def _reference(arch, model_dir, diffusion: DiffusionConfig, task, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients as diffusers' training scripts compute them, with the task's draws."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel, WanTransformer3DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    c = diffusion
    latents, noise = batch.latents, batch.draw.noise
    b = latents.shape[0]
    # the same draws from the same generator: u as diffusers draws it, then the noise
    generator = task.flow.generator(task.config.train.seed, 0)
    u = compute_density_for_timestep_sampling(
        c.timestep_sampling,
        b if c.timestep_per == "sample" else 1,
        c.logit_mean,
        c.logit_std,
        c.mode_scale,
        generator=generator,
    )
    u = c.min_timestep_boundary + u * (c.max_timestep_boundary - c.min_timestep_boundary)
    indices = (u * 1000).long().expand(b)
    assert torch.equal(indices, batch.draw.indices)
    assert torch.equal(torch.randn(latents.shape, generator=generator), noise)

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=c.shift)
    timesteps = scheduler.timesteps[indices]
    sigmas = scheduler.sigmas[indices]
    noisy = scheduler.scale_noise(latents, timesteps, noise)
    text, pooled = _pipeline_text(task.features, batch.indices, task.features.null(), batch.draw.drop.tolist())
    if arch == WAN:
        model = WanTransformer3DModel.from_pretrained(model_dir)
        pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=text).sample
    else:
        model = FluxTransformer2DModel.from_pretrained(model_dir)
        _, channels, height, width = latents.shape
        pred = model(
            hidden_states=FluxPipeline._pack_latents(noisy, b, channels, height, width),
            timestep=timesteps / 1000,
            guidance=torch.full((b,), c.guidance_scale),
            pooled_projections=pooled,
            encoder_hidden_states=text,
            txt_ids=torch.zeros(TEXT_LEN, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, height // 2, width // 2, "cpu", torch.float32),
        ).sample
        pred = FluxPipeline._unpack_latents(pred, height * 8, width * 8, 8)
    if c.loss_weighting == "bsmntw":  # MindSpeed-MM's WanFlowMatchScheduler.training_weight
        y = torch.exp(-2 * ((scheduler.timesteps - 500) / 1000) ** 2)
        y = y - y.min()
        weighting = (y * (1000 / y.sum()))[indices]
    else:
        weighting = compute_loss_weighting_for_sd3(c.loss_weighting, sigmas) * torch.ones(b)
    weighting = weighting.reshape(b, *[1] * (latents.ndim - 1))
    target = noise - latents
    loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


CASES = [
    (WAN, {"shift": 5.0, "timestep_per": "microbatch", "loss_weighting": "bsmntw"}, 2),  # MindSpeed-MM's Wan
    (
        WAN,
        {
            "shift": 3.0,
            "timestep_sampling": "logit_normal",
            "logit_std": 1.5,
            "loss_weighting": "sigma_sqrt",
            "text_dropout": 0.5,
        },
        3,
    ),
    (WAN, {"shift": 5.0, "timestep_sampling": "mode", "min_timestep_boundary": 0.417, "loss_weighting": "cosmap"}, 2),
    (FLUX, {"timestep_sampling": "logit_normal", "guidance_scale": 3.5, "text_dropout": 0.5}, 3),
]


def _overrides(model_dir, features, **extra) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        f"data.text_len={TEXT_LEN}",
        "data.shuffle=false",
        "train.precision=fp32",
        "logging.progress=false",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


def _parity(cases, runs) -> list[dict]:
    results = []
    for arch, diffusion, micro in cases:
        model_dir, features = runs[arch]
        config = load_mm_config(
            None,
            _overrides(model_dir, features, **{"train.micro_batch_size": micro})
            + [f"diffusion.{k}={v}" for k, v in diffusion.items()],
        )
        task = TASKS.get("dit")(config, 1)
        batch = task.microbatches(1, 0)[0]
        loss, _ = task.loss(batch, torch.zeros(2))
        loss.backward()
        ours = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in task.model.named_parameters()}
        expected, grads = _reference(arch, model_dir, config.diffusion, task, batch)
        error = max(float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items())
        results.append(
            {
                "arch": arch,
                "loss": float(loss),
                "expected": expected,
                "grad_error": error,
                "names": set(ours) == set(grads),
                "dropped": int(batch.draw.drop.sum()),
                "indices": batch.draw.indices.tolist(),
            }
        )
    # bf16 (FSDP2's policy): the loss stays near fp32's, the backward runs, and the timestep reaches
    # Wan's time embedding in float32, exactly the grid's
    seen, bf16 = {}, {}
    for arch in (WAN, FLUX):
        losses = []
        for precision in ("fp32", "bf16"):
            config = load_mm_config(
                None, _overrides(*runs[arch], **{"train.precision": precision, "train.micro_batch_size": 2})
            )
            task = TASKS.get("dit")(config, 1)
            if arch == WAN and precision == "bf16":
                task.model.condition_embedder.register_forward_pre_hook(lambda m, args: seen.update(timestep=args[0]))
            batch = task.microbatches(1, 0)[0]
            loss = task.loss(batch, torch.zeros(2))[0]
            loss.backward()
            losses.append(float(loss))
            if arch == WAN and precision == "bf16":
                seen["grid"] = task.flow.timesteps[batch.draw.indices]
        bf16[arch] = losses
    results.append({"bf16_timestep": seen["timestep"], "grid": seen["grid"], "bf16": bf16})
    # a cache of two latent shapes: every microbatch is of one shape, and the loss runs on both
    task = TASKS.get("dit")(load_mm_config(None, _overrides(*runs["mixed"], **{"train.micro_batch_size": 2})), 1)
    shapes = set()
    for step in range(1, 5):
        batch = task.microbatches(step, 0)[0]
        shapes.add(tuple(batch.latents.shape))
        assert torch.isfinite(task.loss(batch, torch.zeros(2))[0])
    results.append({"mixed_shapes": shapes})
    return results


def test_loss_and_gradients_equal_diffusers_reference(tiny_runs) -> None:
    results = launch(_parity, (CASES, tiny_runs))
    for result, (arch, diffusion, _) in zip(results, CASES):
        assert result["names"], arch
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), (arch, diffusion)
        assert result["grad_error"] < 1e-5, (arch, diffusion, result["grad_error"])
        print(
            f"{arch} {diffusion}: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative "
            f"gradient error {result['grad_error']:.1e}, timesteps {result['indices']}, dropped {result['dropped']}"
        )
    assert len(set(results[0]["indices"])) == 1 and min(results[2]["indices"]) >= 417  # per microbatch; boundary
    assert any(r["dropped"] for r in results[:4])  # the dropout path was exercised
    assert results[-1]["mixed_shapes"] == {(2, 4, 3, 4, 4), (2, 4, 2, 6, 4)}
    bf16 = results[-2]
    assert bf16["bf16_timestep"].dtype == torch.float32 and torch.equal(bf16["bf16_timestep"], bf16["grid"])
    for arch, (fp32, half) in bf16["bf16"].items():
        print(f"{arch}: fp32 loss {fp32:.6f}, bf16 {half:.6f}")
        assert half == pytest.approx(fp32, rel=2e-2) and half != fp32, arch


def test_bucket_order() -> None:
    keys = ["a", "b", "a", "c", "a", "b", "b", "a", "a", "b", "c"]  # a: 5, b: 4, c: 2
    one = BucketOrder(keys, micro=2, accumulation=4, world=1, seed=3, shuffle=True)
    two = BucketOrder(keys, micro=2, accumulation=2, world=2, seed=3, shuffle=True)
    assert one.per_epoch == 5  # a: 2, b: 2, c: 1 (one "a" left out each epoch)
    seen = []
    for step in (1, 2, 3):
        for rank in (0, 1):
            for j in (0, 1):
                indices = two.indices(step, rank, j)
                assert indices == one.indices(step, 0, rank * 2 + j)  # DP2 sees what DP1 accumulates
                assert len(indices) == 2 and keys[indices[0]] == keys[indices[1]]
                seen.append(indices)
    first_epoch = [i for indices in seen[:5] for i in indices]
    assert len(set(first_epoch)) == 10  # no sample twice in an epoch
    assert seen[:5] != seen[5:10]  # each epoch its own order
    with pytest.raises(ValueError, match="lower train.micro_batch_size"):
        BucketOrder(keys, micro=6, accumulation=1, world=1, seed=0, shuffle=False)


def _dp2(rank: int, world: int, runs, root) -> list[dict] | None:
    export = [f"checkpoint.save={root / 'ckpt'}", f"checkpoint.save_hf={root / 'hf'}"]
    records = [
        r
        for arch in (WAN, FLUX)
        for r in train(load_mm_config(None, _dp_overrides(runs[arch], 1) + (export if arch == WAN else []))).records
    ]
    # train.ema: EMA-AdamW, a checkpoint per step, the averages exported; then a run resumed from step 1
    ema = _dp_overrides(runs[WAN], 1) + ["train.ema=0.9", "checkpoint.interval=1"]
    train(load_mm_config(None, ema + [f"checkpoint.save={root / 'ema'}", f"checkpoint.save_hf={root / 'hf_ema'}"]))
    if rank == 0:
        shutil.copytree(root / "ema" / "step_00000001", root / "ema_resumed" / "step_00000001")
    dist.barrier()
    resumed = train(
        load_mm_config(
            None, ema + [f"checkpoint.save={root / 'ema_resumed'}", f"checkpoint.save_hf={root / 'hf_ema_resumed'}"]
        )
    )
    assert resumed.start_step == 1
    return records if rank == 0 else None


def _dp1(runs) -> list[dict]:
    return [r for arch in (WAN, FLUX) for r in train(load_mm_config(None, _dp_overrides(runs[arch], 2))).records]


def _dp_overrides(run, accumulation: int) -> list[str]:
    return _overrides(
        *run,
        **{
            "train.steps": DP_STEPS,
            "train.micro_batch_size": 2,
            "train.lr": 1e-3,
            "train.gradient_accumulation_steps": accumulation,
            "data.shuffle": "true",
            "diffusion.shift": 3.0,
            "diffusion.timestep_sampling": "logit_normal",
            "diffusion.text_dropout": 0.3,
            "train.recompute_modules": "[blocks.*]" if run[0].parent.name == WAN else "[]",
        },
    )


def test_dp2_equals_dp1_and_diffusers_export(tiny_runs, tmp_path) -> None:
    dp2 = run_distributed(_dp2, 2, tiny_runs, tmp_path, timeout=300)[0]
    dp1 = launch(_dp1, (tiny_runs,))
    steps = list(range(1, DP_STEPS + 1))
    assert [r["step"] for r in dp1] == [r["step"] for r in dp2] == steps + steps  # Wan's, then FLUX's
    for one, two in zip(dp1, dp2, strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["step"]
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), one["step"]
        assert two["tokens"] == one["tokens"]

    # the export is a diffusers directory holding exactly the weights of the last DCP checkpoint
    from diffusers import WanTransformer3DModel
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    exported, info = WanTransformer3DModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    dcp_to_torch_save(tmp_path / "ckpt" / f"step_{DP_STEPS:08d}", tmp_path / "last.pt")
    trained = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    weights = exported.state_dict()
    assert set(trained) == set(weights)
    assert all(torch.equal(weights[name], value) for name, value in trained.items())
    before = WanTransformer3DModel.from_pretrained(tiny_runs[WAN][0]).state_dict()
    assert not all(torch.equal(before[name], value) for name, value in trained.items())  # it trained

    # EMA: the exported weights are the averages of the last checkpoint, which equal
    # a_k = d a_(k-1) + (1 - d) p_k from a_0 = p_0 over the initial weights and the checkpoints' weights
    decay = 0.9
    steps = []
    for step in range(1, DP_STEPS + 1):
        dcp_to_torch_save(tmp_path / "ema" / f"step_{step:08d}", tmp_path / f"ema{step}.pt")
        steps.append(torch.load(tmp_path / f"ema{step}.pt", weights_only=False))
    averages = {name: state["ema"] for name, state in steps[-1]["optim"]["state"].items()}
    assert set(averages) == set(before)
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "hf_ema").state_dict()
    resumed = WanTransformer3DModel.from_pretrained(tmp_path / "hf_ema_resumed").state_dict()
    for name, average in averages.items():
        expected = before[name]
        for state in steps:
            expected = decay * expected + (1 - decay) * state["model"][name]
        torch.testing.assert_close(average, expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(exported[name], average) and torch.equal(resumed[name], average), name
        assert not torch.equal(average, steps[-1]["model"][name])


def test_feature_cache_errors(tmp_path) -> None:
    from mindspeed_mm.data.features import FeatureSet, write_features

    cache = write_features(
        tmp_path / "broken",
        [{"latents": torch.zeros(4, 1, 2, 2), "text": torch.zeros(2, 16)}, {"latents": torch.zeros(4, 1, 2, 2)}],
    )
    features = FeatureSet(cache)
    assert len(features) == 2 and features.shapes() == [(4, 1, 2, 2)] * 2 and features.null() is None
    assert set(features[0]) == {"latents", "text"}
    with pytest.raises(ValueError, match="sample 000001 has no 000001.text; re-extract"):
        features[1]
    (cache / "index.jsonl").write_text('{"id": "000000"}\n')
    with pytest.raises(ValueError, match="index.jsonl:1: a line needs `id` and `shard`"):
        FeatureSet(cache)


def test_config_errors(tiny_runs, tmp_path) -> None:
    model_dir, features = tiny_runs[WAN]
    base = [f"model.path={model_dir}"]
    config = load_mm_config(None, base)
    assert config.task() == "dit"
    with pytest.raises(ValueError, match="data.features is unset"):
        config.check(1)
    with pytest.raises(ValueError, match="has no index.jsonl"):
        load_mm_config(None, base + [f"data.features={tmp_path}"]).check(1)
    for key, value, message in (
        ("shift", 0, "diffusion.shift"),
        ("text_dropout", 1.5, "diffusion.text_dropout"),
        ("min_timestep_boundary", 1.0, "min < max"),
        ("timestep_sampling", "beta", "timestep_sampling"),
    ):
        with pytest.raises(ValueError, match=message):
            load_mm_config(None, base + [f"data.features={features}", f"diffusion.{key}={value}"]).check(1)
    features_key = f"data.features={features}"
    usp = load_mm_config(
        None, base + [features_key, "parallel.ulysses_parallel_size=2", "parallel.ring_attention_size=2"]
    )
    usp.check(4)
    assert usp.parallel.sequence_algo == "hybrid_cp_algo" and usp.samples_per_step(8) == 2
    ring = ["parallel.ring_attention_size=2"]
    assert load_mm_config(None, base + [features_key, *ring]).parallel.sequence_algo == "megatron_cp_algo"
    for extra, world, message in (
        (["parallel.context_parallel_algo=hybrid_cp_algo"], 2, "needs parallel.ring_attention_size > 1"),
        (
            [*ring, "parallel.ulysses_parallel_size=2", "parallel.context_parallel_algo=megatron_cp_algo"],
            4,
            "contradicts",
        ),
        ([*ring, "parallel.ulysses_parallel_size=2"], 2, "not divisible"),
    ):
        with pytest.raises(ValueError, match=message):
            load_mm_config(None, base + [features_key, *extra]).check(world)
