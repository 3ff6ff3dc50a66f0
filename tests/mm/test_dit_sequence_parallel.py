"""Ulysses sequence parallelism of diffusion transformers equals the unsplit run, in one spawned group of two gloo ranks.

SP2 (both ranks hold each microbatch, each holds half of its video / image tokens) against SP1
(one rank), fp32:

- the loss and every parameter's gradient of a training step (gathered from the FSDP2 shards):
  Wan (video tokens split, cross-attention text replicated, blocks recomputed) and FLUX (joint
  text + image attention; 9 image and 8 text tokens: uneven shards), rel 1e-5;
- two steps of ``train`` (loss, gradient norm, token counts);
- sampling (Euler, classifier-free guidance against a negative text) from the same noise;
- ``parallel.context_parallel_algo=megatron_cp_algo`` (the core's ring attention) on Wan: the loss rel
  1e-5, every gradient rel 1e-4 (the ring's log-sum-exp merge rounds differently);
- training from raw media: each rank encodes half of the samples (VAE and text encoder), the
  losses equal SP1's.

The Ulysses all-to-all (or the ring) must have run in every attention over the split tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from mindspeed.testing.distributed import run_distributed
from mindspeed_llm.training.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.testing.media_fixtures import write_tiny_pipeline, write_video
from mindspeed_mm.trainer.loop import train
from mindspeed_mm.trainer.task import TASKS

WAN, FLUX = "WanTransformer3DModel", "FluxTransformer2DModel"
#: one latent shape per family: 3 x 2 x 2 = 12 Wan tokens, 3 x 3 = 9 FLUX image tokens
SHAPES = {WAN: (4, 3, 4, 4), FLUX: (4, 6, 6)}


def _overrides(run: tuple[Path, Path], sp: int) -> list[str]:
    model_dir, features = run
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        "data.text_len=8",
        "train.precision=fp32",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.lr=1e-3",
        "diffusion.text_dropout=0.3",
        "diffusion.timestep_sampling=logit_normal",
        "logging.progress=false",
        f"parallel.ulysses_parallel_size={sp}",
        *(["train.recompute_modules=[blocks.*]"] if model_dir.parent.name == WAN else []),
    ]


def _step(overrides: list[str]) -> dict:
    """Step 1's reported loss and gradients (numpy: tensors do not outlive the spawned rank), and the Ulysses calls."""
    world = dist.get_world_size()
    config = load_mm_config(None, overrides)
    config.check(world)
    task = TASKS.get("dit")(config, world)
    micro = task.microbatches(1, dist.get_rank())
    totals = task.counts(micro)
    dist.all_reduce(totals)
    reported = torch.zeros(())
    for batch in micro:
        loss, share = task.loss(batch, totals)
        loss.backward()
        reported += share
    dist.all_reduce(reported)
    grads = {
        n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)().numpy()
        for n, p in task.model.named_parameters()
        if p.grad is not None
    }
    calls = task.sequence.calls if task.sequence is not None else 0
    return {"loss": float(reported), "grads": grads, "calls": calls, "totals": totals.tolist()}


def _sample(arch: str, model_dir: Path) -> dict:
    """Latents sampled without and then with sequence parallelism (the same model, noise and texts)."""
    from mindspeed_mm.diffusion.sampler import build_scheduler, sample_latents
    from mindspeed_mm.models.dit import DIT_FAMILIES, load_dit
    from mindspeed_mm.models.dit_parallel import apply_sequence_parallel

    family = DIT_FAMILIES.get(arch)
    model = load_dit(model_dir, family).eval()
    config = family.tiny_config
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn((2, *SHAPES[arch]), generator=gen)
    dim = config.get("text_dim") or config["joint_attention_dim"]
    text, negative = torch.randn(2, 8, dim, generator=gen), torch.randn(2, 8, dim, generator=gen)
    pooled = torch.randn(2, config["pooled_projection_dim"], generator=gen) if family.needs_pooled else None

    def sample() -> torch.Tensor:
        scheduler = build_scheduler(family, sampler="euler", flow_shift=3.0)
        return sample_latents(model, family, scheduler, noise, text, 3, pooled, negative, pooled, 4.0)

    one = sample()
    parallel = apply_sequence_parallel(model, family.sequence_plan, dist.group.WORLD)
    two = sample()
    return {"one": one.numpy(), "two": two.numpy(), "calls": parallel.calls}


def _raw(recipe: Path, sp: int) -> dict:
    """Losses of 2 steps from raw media, and the samples this rank encoded."""
    from mindspeed_mm.data.media_features import MediaFeatures

    encoded = []
    original = MediaFeatures.__getitem__

    def counted(self, index):
        encoded.append(index)
        return original(self, index)

    MediaFeatures.__getitem__ = counted
    try:
        overrides = [
            "train.steps=2",
            "train.micro_batch_size=2",
            "train.precision=fp32",
            "train.lr=1e-3",
            "logging.progress=false",
            f"parallel.ulysses_parallel_size={sp}",
        ]
        losses = [r["loss"] for r in train(load_mm_config(recipe, overrides)).records]
    finally:
        MediaFeatures.__getitem__ = original
    return {"losses": losses, "encoded": encoded}


def _sp2(rank: int, world: int, runs: dict, recipe: Path) -> dict:
    out = {arch: _step(_overrides(runs[arch], 2)) for arch in (WAN, FLUX)}
    out["ring"] = _step([*_overrides(runs[WAN], 2), "parallel.context_parallel_algo=megatron_cp_algo"])
    out["train"] = {arch: train(load_mm_config(None, _overrides(runs[arch], 2))).records for arch in (WAN, FLUX)}
    out["sample"] = {arch: _sample(arch, runs[arch][0]) for arch in (WAN, FLUX)}
    out["raw"] = _raw(recipe, 2)
    return out


def _sp1(runs: dict, recipe: Path) -> dict:
    out = {arch: _step(_overrides(runs[arch], 1)) for arch in (WAN, FLUX)}
    out["train"] = {arch: train(load_mm_config(None, _overrides(runs[arch], 1))).records for arch in (WAN, FLUX)}
    out["raw"] = _raw(recipe, 1)
    return out


def _media_recipe(root: Path) -> Path:
    """A tiny Wan pipeline and 4 noise clips (5 frames of 16 x 16 at 4 fps: 2 tokens each) to train from raw media."""
    pipeline = write_tiny_pipeline(root / "wan", WAN)
    records = []
    for i in range(4):
        frames = np.random.default_rng(i).integers(0, 256, (12, 16, 16, 3), dtype=np.uint8)
        write_video(root / f"media/a{i}.mov", frames, fps=8)
        records.append({"path": f"a{i}.mov", "cap": f"clip {i} moves left", "num_frames": 12, "fps": 8})
    (root / "videos.json").write_text(json.dumps(records))
    recipe = {
        "model": {"path": str(pipeline / "transformer")},
        "data": {
            "files": [str(root / "videos.json")],
            "image_dir": str(root / "media"),
            "resolutions": [[16, 16]],
            "frame_counts": [5],
            "fps": 4,
            "text_len": 12,
            "shuffle": False,
        },
        "diffusion": {"text_dropout": 0.5},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_sp2_equals_sp1(tmp_path) -> None:
    runs = {arch: write_tiny_dit_run(tmp_path / arch, arch, latent_shapes=[SHAPES[arch]]) for arch in (WAN, FLUX)}
    recipe = _media_recipe(tmp_path / "media")
    two = run_distributed(_sp2, 2, runs, recipe, timeout=600)
    one = launch(_sp1, (runs, recipe))
    # Wan: 2 blocks' self-attention, recomputed in the backward; FLUX: 1 double- and 1 single-stream block
    for arch, calls in ((WAN, 4), (FLUX, 2)):
        a, b = one[arch], two[0][arch]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), arch
        assert a["grads"].keys() == b["grads"].keys() and len(a["grads"]) > 60
        for name, grad in a["grads"].items():
            scale = max(float(np.abs(grad).max()), 1e-12)
            assert float(np.abs(b["grads"][name] - grad).max()) / scale < 1e-5, (arch, name)
        assert b["calls"] == calls  # one Ulysses call per attention over the split tokens
        assert b["totals"] == a["totals"]  # samples and tokens counted once per group
        for x, y in zip(one["train"][arch], two[0]["train"][arch]):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (arch, x["step"])
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (arch, x["step"])
            assert y["tokens"] == x["tokens"]
        sample = two[0]["sample"][arch]
        np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
        assert sample["calls"] == 2 * 3 * 2  # 2 attentions, 3 steps, conditional and unconditional
        np.testing.assert_array_equal(two[1]["sample"][arch]["two"], sample["two"])  # every rank has the output
    # ring attention (the core's megatron_cp_algo over the same group): Wan's 12 tokens, 6 a rank
    ring, a = two[0]["ring"], one[WAN]
    assert ring["loss"] == pytest.approx(a["loss"], rel=1e-5) and ring["calls"] == 4
    for name, grad in a["grads"].items():
        scale = max(float(np.abs(grad).max()), 1e-12)
        assert float(np.abs(ring["grads"][name] - grad).max()) / scale < 1e-4, ("ring", name)
    # raw media: each rank of the group encoded one sample of every microbatch of 2, the losses are SP1's
    assert len(one["raw"]["encoded"]) == 4
    assert [len(r["raw"]["encoded"]) for r in two] == [2, 2]
    assert sorted(two[0]["raw"]["encoded"] + two[1]["raw"]["encoded"]) == sorted(one["raw"]["encoded"])
    np.testing.assert_allclose(two[0]["raw"]["losses"], one["raw"]["losses"], rtol=1e-5)
