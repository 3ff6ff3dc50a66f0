"""Sequence parallelism of diffusion transformers equals the unsplit run: a spawned group of two gloo ranks
(Ulysses, ring) and one of four (USP: Ulysses 2 x ring 2), both against one SP1 rank.

SP2 (both ranks hold each microbatch, each holds half of its video / image tokens) against SP1
(one rank), fp32:

- the loss and every parameter's gradient of a training step (gathered from the FSDP2 shards):
  Wan (video tokens split, cross-attention text replicated, blocks recomputed) and FLUX (joint
  text + image attention; 9 image and 8 text tokens: uneven shards), rel 1e-5;
- two steps of ``train`` (loss, gradient norm, token counts);
- sampling (Euler, classifier-free guidance against a negative text) from the same noise;
- ``parallel.context_parallel_algo=megatron_cp_algo`` (the core's ring attention) on Wan: the loss rel
  1e-5, every gradient rel 1e-4 (the ring's log-sum-exp merge rounds differently);
- Wan I2V (the mask and first-frame latents on the input channels, CLIP image features in every block's
  cross-attention, 512 text tokens): the loss rel 1e-5; every gradient's error below 1e-4 of the tensor's
  largest gradient or of 1e-2 x the model's, whichever is larger (measured worst: 7.6e-6, on
  ``blocks.1.attn2.to_k.bias``, whose gradients reach it only through the keys' RMS norm, are 5e-4 of the
  model's largest and cancel over the 517 context tokens: summed in another order they are 1.6e-4 of their
  own largest apart, 8e-8 of the model's);
- SD3 (joint attention over both streams' shards, 9 image + 8 text tokens): the loss rel 1e-5 and every
  gradient rel 1e-5; sampling with guidance; SD3.5's blocks (``dual_attention_layers=(0,)``, QK RMSNorm): block
  0's image-only ``attn2`` through its own all-to-all over the 9 image tokens' shards, the loss and every
  gradient rel 1e-5, and sampling with guidance and skip-layer guidance (block 0 skipped on 2 of 3 steps);
- LoRA on Wan (r 4, alpha 8, the family's default targets; FSDP2 over the 2 ranks): the loss and every LoRA
  factor's gradient rel 1e-5;
- training from raw media: each rank encodes half of the samples (VAE and text encoder), the
  losses equal SP1's.

USP (``parallel.ulysses_parallel_size=2``, ``parallel.ring_attention_size=2``: the core's hybrid_cp_algo
over 4 ranks, FSDP2 over 4) against SP1, fp32: step 1's loss and gradients of Wan (blocks recomputed) and
FLUX and SD3 and SD3.5 (9 image + 8 text tokens: uneven shares), and of Wan with LoRA (only the factors train); two ``train``
steps of Wan; sampling of both; and the VAE decode split over the ranks (3 videos on 4 ranks:
:func:`~mindspeed_mm.diffusion.sampler.decode_shared`) equals one decode of all.

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

from mindspeed.launch import launch
from mindspeed.testing.distributed import run_distributed
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.models.dit import write_tiny_dit
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.testing.media_fixtures import write_tiny_pipeline, write_video
from mindspeed_mm.trainer.loop import train
from mindspeed_mm.trainer.task import TASKS

WAN, FLUX, I2V = "WanTransformer3DModel", "FluxTransformer2DModel", "WanTransformer3DModel:i2v"
TI2V = "WanTransformer3DModel:ti2v"
SD3 = "SD3Transformer2DModel"
#: SD3.5's blocks: the tiny SD3 with ``dual_attention_layers=(0,)`` (an image-only second attention) and QK RMSNorm
SD35 = "sd3.5"
#: one latent shape per family: 3 x 2 x 2 = 12 Wan tokens, 3 x 3 = 9 FLUX and SD3 image tokens
SHAPES = {WAN: (4, 3, 4, 4), TI2V: (4, 3, 4, 4), FLUX: (4, 6, 6), SD3: (4, 6, 6)}


LORA = ["lora.target_modules=[default]", "lora.r=4", "lora.alpha=8"]
USP = ["parallel.ulysses_parallel_size=2", "parallel.ring_attention_size=2"]


def _overrides(run: tuple[Path, Path], sp: int, *extra: str) -> list[str]:
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
        *extra,
    ]


def _step(overrides: list[str]) -> dict:
    """Step 1's reported loss and gradients (numpy: tensors do not outlive the spawned rank), and the Ulysses calls."""
    world = dist.get_world_size()
    config = load_mm_config(None, overrides)
    config.check(world)
    torch.manual_seed(config.train.seed)  # as train() does: LoRA's initial factors are drawn
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
    masked = task.sequence.masked_calls if task.sequence is not None else 0
    return {"loss": float(reported), "grads": grads, "calls": calls, "masked": masked, "totals": totals.tolist()}


def _sample(
    arch: str,
    model_dir: Path,
    algo: str = "ulysses_cp_algo",
    ulysses: int | None = None,
    image: bool = False,
    skip_layers: tuple[int, ...] = (),
) -> dict:
    """Latents sampled without and then with sequence parallelism (the same model, noise and texts; with ``image``
    Wan2.2 TI2V's first-frame latents; with ``skip_layers`` SD3's skip-layer guidance on steps 1 and 2 of 3)."""
    from mindspeed_mm.diffusion.sampler import SkipLayerGuidance, build_scheduler, sample_latents
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
    conditions = (
        {"image_latents": torch.randn(2, noise.shape[1], 1, *noise.shape[3:], generator=gen)} if image else None
    )

    def sample() -> torch.Tensor:
        scheduler = build_scheduler(family, sampler="euler", flow_shift=3.0)
        guide = SkipLayerGuidance(skip_layers, 2.8, 0.01, 0.9) if skip_layers else None
        return sample_latents(
            model,
            family,
            scheduler,
            noise,
            text,
            3,
            pooled,
            negative,
            pooled,
            4.0,
            conditions=conditions,
            skip_guidance=guide,
        )

    one = sample()
    parallel = apply_sequence_parallel(model, family.sequence_plan, dist.group.WORLD, algo, ulysses)
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
    out[I2V] = _step(_overrides(runs[I2V], 2, "data.text_len=512"))
    out[TI2V] = _step(_overrides(runs[TI2V], 2, "diffusion.first_frame_ratio=0.5"))
    out["sample_ti2v"] = {image: _sample(TI2V, runs[TI2V][0], image=image) for image in (False, True)}
    out["lora"] = _step(_overrides(runs[WAN], 2, *LORA))
    out["train"] = {arch: train(load_mm_config(None, _overrides(runs[arch], 2))).records for arch in (WAN, FLUX)}
    out["sample"] = {arch: _sample(arch, runs[arch][0]) for arch in (WAN, FLUX, SD3)}
    out[SD3] = _step(_overrides(runs[SD3], 2))
    out[SD35] = _step(_overrides(runs[SD35], 2))
    out["sample_sd35"] = _sample(SD3, runs[SD35][0], skip_layers=(0,))
    out["raw"] = _raw(recipe, 2)
    return out


def _sp1(runs: dict, recipe: Path) -> dict:
    out = {arch: _step(_overrides(runs[arch], 1)) for arch in (WAN, FLUX)}
    out[I2V] = _step(_overrides(runs[I2V], 1, "data.text_len=512"))
    out[TI2V] = _step(_overrides(runs[TI2V], 1, "diffusion.first_frame_ratio=0.5"))
    out[SD3] = _step(_overrides(runs[SD3], 1))
    out[SD35] = _step(_overrides(runs[SD35], 1))
    out["lora"] = _step(_overrides(runs[WAN], 1, *LORA))
    out["train"] = {arch: train(load_mm_config(None, _overrides(runs[arch], 1))).records for arch in (WAN, FLUX)}
    out["raw"] = _raw(recipe, 1)
    return out


def _decode(pipeline: Path) -> dict:
    """3 videos' latents decoded by the ranks' shares (group rank 0 gets them) and all at once on one rank."""
    from diffusers import AutoencoderKLWan

    from mindspeed_mm.diffusion.sampler import decode_latents, decode_shared

    vae = AutoencoderKLWan.from_pretrained(str(pipeline / "vae")).eval()
    latents = torch.randn((3, 4, 2, 2, 2), generator=torch.Generator().manual_seed(5))
    calls = []
    original = vae.decode

    def counted(z, *args, **kwargs):
        calls.append(z.shape[0])
        return original(z, *args, **kwargs)

    vae.decode = counted
    shared = decode_shared(vae, latents, dist.group.WORLD)
    decoded_here = list(calls)
    return {
        "shared": None if shared is None else shared.numpy(),
        "one": decode_latents(vae, latents).numpy(),
        "decoded": decoded_here,
    }


def _usp(rank: int, world: int, runs: dict, pipeline: Path) -> dict:
    out = {arch: _step(_overrides(runs[arch], 2, *USP[1:])) for arch in (WAN, FLUX, SD3, SD35)}
    out["lora"] = _step(_overrides(runs[WAN], 2, *USP[1:], *LORA))
    out["train"] = train(load_mm_config(None, _overrides(runs[WAN], 2, *USP[1:]))).records
    out["sample"] = {arch: _sample(arch, runs[arch][0], "hybrid_cp_algo", 2) for arch in (WAN, FLUX, SD3)}
    out["decode"] = _decode(pipeline)
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny runs, the raw-media recipe and the SP1 results (one launch for both tests)."""
    root = tmp_path_factory.mktemp("dit-sp")
    runs = {arch: write_tiny_dit_run(root / arch, arch, latent_shapes=[SHAPES[arch]]) for arch in (WAN, FLUX)}
    runs[I2V] = write_tiny_dit_run(root / "i2v", I2V, latent_shapes=[SHAPES[WAN]])
    runs[TI2V] = write_tiny_dit_run(root / "ti2v", TI2V, latent_shapes=[SHAPES[TI2V]])
    (root / "ti2v" / "model_index.json").write_text(json.dumps({"expand_timesteps": True}))
    runs[SD3] = write_tiny_dit_run(root / "sd3", SD3, latent_shapes=[SHAPES[SD3]])
    runs[SD35] = write_tiny_dit_run(root / "sd35", SD3, latent_shapes=[SHAPES[SD3]])
    write_tiny_dit(runs[SD35][0], SD3, dual_attention_layers=(0,), qk_norm="rms_norm")
    recipe = _media_recipe(root / "media")
    return {"runs": runs, "recipe": recipe, "root": root, "one": launch(_sp1, (runs, recipe))}


def _close_grads(one: dict, two: dict, rel: float, what: str, floor: float = 0.0) -> float:
    """The largest gradient error relative to the parameter's largest gradient (asserted below ``rel``); with
    ``floor``, relative to at least ``floor`` x the model's largest gradient."""
    assert one["grads"].keys() == two["grads"].keys()
    worst, worst_name, largest = 0.0, "", max(float(np.abs(g).max()) for g in one["grads"].values())
    for name, grad in one["grads"].items():
        scale = max(float(np.abs(grad).max()), floor * largest, 1e-12)
        error = float(np.abs(two["grads"][name] - grad).max()) / scale
        assert error < rel, (what, name, error)
        if error > worst:
            worst, worst_name = error, name
    if floor:
        print(
            f"{what}: worst gradient error {worst:.1e} ({worst_name}, its largest {np.abs(one['grads'][worst_name]).max():.1e}, the model's {largest:.1e})"
        )
    return worst


def test_sp2_equals_sp1(tiny) -> None:
    runs, recipe, one = tiny["runs"], tiny["recipe"], tiny["one"]
    two = run_distributed(_sp2, 2, runs, recipe, timeout=600)
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
        assert [r["step"] for r in one["train"][arch]] == [r["step"] for r in two[0]["train"][arch]] == [1, 2]
        for x, y in zip(one["train"][arch], two[0]["train"][arch], strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (arch, x["step"])
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (arch, x["step"])
            assert y["tokens"] == x["tokens"]
        sample = two[0]["sample"][arch]
        np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
        assert sample["calls"] == 2 * 3 * 2  # 2 attentions, 3 steps, conditional and unconditional
        np.testing.assert_array_equal(two[1]["sample"][arch]["two"], sample["two"])  # every rank has the output
    # Wan I2V: the conditioned input and the image cross-attention under Ulysses (2 blocks, not recomputed)
    a, b = one[I2V], two[0][I2V]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["calls"] == 2 and b["totals"] == a["totals"]
    assert any("add_k_proj" in name for name in a["grads"])
    print(
        f"Wan I2V SP2: loss {b['loss']:.6f} (SP1 {a['loss']:.6f}), worst gradient {_close_grads(a, b, 1e-4, 'i2v', 1e-2):.1e}"
    )
    # Wan2.2 TI2V: per-token timesteps split as the tokens (the first frame's 4 tokens, at timestep 0 where
    # the draw gives the frame, all on rank 0), the first frame left out of those samples' loss
    a, b = one[TI2V], two[0][TI2V]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["calls"] == 2 and b["totals"] == a["totals"]
    print(
        f"Wan TI2V SP2: loss {b['loss']:.6f} (SP1 {a['loss']:.6f}), worst gradient {_close_grads(a, b, 1e-5, 'ti2v'):.1e}"
    )
    for image, sample in two[0]["sample_ti2v"].items():
        np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
        assert sample["calls"] == 2 * 3 * 2, image
    with_image, without = two[0]["sample_ti2v"][True]["one"], two[0]["sample_ti2v"][False]["one"]
    assert np.abs(with_image[:, :, 1:] - without[:, :, 1:]).max() > 1e-3  # the image conditioned the rest
    # SD3: joint attention over both streams' shards (9 image + 8 text tokens: uneven), 2 blocks
    a, b = one[SD3], two[0][SD3]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["calls"] == 2 and b["totals"] == a["totals"]
    assert len(a["grads"]) > 60
    print(f"SD3 SP2: loss {b['loss']:.6f} (SP1 {a['loss']:.6f}), worst gradient {_close_grads(a, b, 1e-5, 'sd3'):.1e}")
    sample = two[0]["sample"][SD3]
    np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
    assert sample["calls"] == 2 * 3 * 2 and np.abs(sample["one"]).max() > 0
    np.testing.assert_array_equal(two[1]["sample"][SD3]["two"], sample["two"])
    # SD3.5: block 0's image-only attn2 over the image shards (its own all-to-all: 9 tokens, 5 + 4), besides
    # both blocks' joint attention
    a, b = one[SD35], two[0][SD35]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["calls"] == 3 and b["totals"] == a["totals"]
    assert sum("attn2" in name for name in a["grads"]) >= 8
    print(
        f"SD3.5 SP2: loss {b['loss']:.6f} (SP1 {a['loss']:.6f}), worst gradient {_close_grads(a, b, 1e-5, 'sd35'):.1e}"
    )
    # SD3.5 sampling with guidance and skip-layer guidance (block 0 skipped on steps 1 and 2 of 3): 3 steps of
    # 2 x 3 attentions, and the 2 skipped-layer calls' 1 (block 1's joint attention)
    sample = two[0]["sample_sd35"]
    np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
    assert sample["calls"] == 3 * 2 * 3 + 2
    print(f"SD3.5 SP2 sampling with SLG: worst error {np.abs(sample['two'] - sample['one']).max():.1e}")
    # ring attention (the core's megatron_cp_algo over the same group): Wan's 12 tokens, 6 a rank
    ring, a = two[0]["ring"], one[WAN]
    assert ring["loss"] == pytest.approx(a["loss"], rel=1e-5) and ring["calls"] == 4
    for name, grad in a["grads"].items():
        scale = max(float(np.abs(grad).max()), 1e-12)
        assert float(np.abs(ring["grads"][name] - grad).max()) / scale < 1e-4, ("ring", name)
    # LoRA on Wan at SP2 (FSDP2 over the 2 ranks): the loss and the factors' gradients are SP1's
    assert two[0]["lora"]["loss"] == pytest.approx(one["lora"]["loss"], rel=1e-5)
    _close_grads(one["lora"], two[0]["lora"], 1e-5, "lora sp2")
    # raw media: each rank of the group encoded one sample of every microbatch of 2, the losses are SP1's
    assert len(one["raw"]["encoded"]) == 4
    assert [len(r["raw"]["encoded"]) for r in two] == [2, 2]
    assert sorted(two[0]["raw"]["encoded"] + two[1]["raw"]["encoded"]) == sorted(one["raw"]["encoded"])
    np.testing.assert_allclose(two[0]["raw"]["losses"], one["raw"]["losses"], rtol=1e-5)


def test_usp_equals_sp1(tiny) -> None:
    """Ulysses 2 x ring 2 over 4 ranks (the core's hybrid_cp_algo) against SP1: training, LoRA, sampling, decoding."""
    pipeline = write_tiny_pipeline(tiny["root"] / "pipeline", WAN)
    four = run_distributed(_usp, 4, tiny["runs"], pipeline, timeout=600)
    one = tiny["one"]
    for arch, calls in ((WAN, 4), (FLUX, 2), (SD3, 2), (SD35, 3)):
        a, b = one[arch], four[0][arch]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), arch
        assert len(a["grads"]) > 60 and b["calls"] == calls and b["totals"] == a["totals"]
        print(
            f"{arch} USP: loss {b['loss']:.6f} (SP1 {a['loss']:.6f}), worst gradient {_close_grads(a, b, 1e-4, arch):.1e}"
        )
        if arch == SD35:
            continue  # sampling: SD3's above covers the family's plan
        sample = four[0]["sample"][arch]
        np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
        assert sample["calls"] == 2 * 3 * 2
        for other in four[1:]:
            np.testing.assert_array_equal(other["sample"][arch]["two"], sample["two"])
    # LoRA under USP and FSDP2 over 4 ranks: the factors' gradients (all that trains) are SP1's
    lora = four[0]["lora"]
    assert lora["loss"] == pytest.approx(one["lora"]["loss"], rel=1e-5)
    assert 0 < len(one["lora"]["grads"]) and all("lora" in name for name in one["lora"]["grads"])
    _close_grads(one["lora"], lora, 1e-4, "lora")
    assert [r["step"] for r in one["train"][WAN]] == [r["step"] for r in four[0]["train"]] == [1, 2]
    for x, y in zip(one["train"][WAN], four[0]["train"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["tokens"] == x["tokens"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    # the VAE decode: ranks 0-2 decoded one video each, rank 3 none; rank 0 got all three, as one decode
    assert [r["decode"]["decoded"] for r in four] == [[1], [1], [1], []]
    assert all(r["decode"]["shared"] is None for r in four[1:])
    shared, whole = four[0]["decode"]["shared"], four[0]["decode"]["one"]
    assert shared.shape == whole.shape == (3, 5, 3, 16, 16)
    np.testing.assert_allclose(shared, whole, rtol=0, atol=1e-6)
