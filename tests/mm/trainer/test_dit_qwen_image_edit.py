"""Qwen-Image-Edit training against diffusers: loss and every gradient.

A tiny ``QwenImageTransformer2DModel`` in a directory whose ``model_index.json`` names ``QwenImageEditPipeline``
is the ``edit`` family; a cache of target latents ``[4, 4, 4]``, source-image latents of another shape
``[4, 6, 4]``, texts of 2-5 tokens and each sample's own null text (the empty prompt encoded with its source
image, 1-3 tokens, which text dropout 0.5 substitutes) trains it. The microbatch's loss and every parameter's gradient equal a
reference computed with a separately loaded diffusers model called as ``QwenImageEditPipeline`` calls it: the
noisy target packed with ``_pack_latents``, the source latents packed and concatenated after it on the sequence,
``img_shapes`` ``[(1, 2, 2), (1, 3, 2)]`` per sample, ``timestep`` ``t / 1000``, the texts zero-padded with
their mask (a dropped sample's own null text), the output's first 4 (target) tokens unpacked; loss ``noise - x0`` on those tokens only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.data.features import write_features
from mindspeed_mm.models.dit import DIT_FAMILIES, dit_family_of, write_tiny_dit
from mindspeed_mm.trainer.task import TASKS

EDIT = "QwenImageTransformer2DModel:edit"
TEXT_LEN = 8
DIFFUSION = {"shift": 3.0, "timestep_sampling": "logit_normal", "loss_weighting": "sigma_sqrt", "text_dropout": 0.5}


def _write_run(directory, null_text: bool = True, text_lengths: tuple[int, ...] = (2, 3, 4, 5), **overrides) -> tuple:
    model_dir = write_tiny_dit(directory / "transformer", EDIT, **overrides)
    (directory / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPipeline"}))
    gen = torch.Generator().manual_seed(1)
    samples = [
        {
            "latents": torch.randn(4, 4, 4, generator=gen),
            "text": torch.randn(text_lengths[i % len(text_lengths)], 64, generator=gen),
            "image_latents": torch.randn(4, 6, 4, generator=gen),
            # the empty prompt encoded with this sample's source image (what text dropout substitutes)
            **({"null_text": torch.randn(1 + i % 3, 64, generator=gen)} if null_text else {}),
        }
        for i in range(6)
    ]
    features = write_features(directory / "features", samples, [f"edit {i}" for i in range(6)])
    return model_dir, features


def _reference(model_dir, task, batch) -> tuple[float, dict[str, torch.Tensor]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageTransformer2DModel
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    c = task.config.diffusion
    latents, noise, indices = batch.latents, batch.draw.noise, batch.draw.indices
    source = batch.conditions["image_latents"]
    b, channels, height, width = latents.shape
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=c.shift)
    timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices]
    s = sigmas.reshape(b, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * noise
    drop = batch.draw.drop.tolist()
    texts = [task.features[i]["null_text" if d else "text"] for i, d in zip(batch.indices, drop)]
    longest = max(len(t) for t in texts)
    text = torch.stack([torch.cat([t, t.new_zeros(longest - len(t), t.shape[1])]) for t in texts])
    mask = torch.stack([torch.arange(longest) < len(t) for t in texts]).long()
    assert not bool(mask.all())
    model = QwenImageTransformer2DModel.from_pretrained(model_dir)
    packed = QwenImageEditPipeline._pack_latents(noisy, b, channels, height, width)
    packed_source = QwenImageEditPipeline._pack_latents(source, b, channels, *source.shape[-2:])
    pred = model(
        hidden_states=torch.cat([packed, packed_source], dim=1),
        timestep=timesteps / 1000,
        encoder_hidden_states=text,
        encoder_hidden_states_mask=mask,
        img_shapes=[[(1, height // 2, width // 2), (1, source.shape[-2] // 2, source.shape[-1] // 2)]] * b,
        return_dict=False,
    )[0]
    pred = pred[:, : packed.size(1)]
    pred = QwenImageEditPipeline._unpack_latents(pred, height * 8, width * 8, 8)[:, :, 0]
    weighting = compute_loss_weighting_for_sd3(c.loss_weighting, sigmas).reshape(b, 1, 1, 1)
    loss = torch.mean((weighting * (pred - (noise - latents)) ** 2).reshape(b, -1), 1).mean()
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def _parity(run) -> dict:
    overrides = [
        f"model.path={run[0]}",
        f"data.features={run[1]}",
        f"data.text_len={TEXT_LEN}",
        "data.shuffle=false",
        "logging.progress=false",
        "train.micro_batch_size=3",
        "train.precision=fp32",
    ] + [f"diffusion.{k}={v}" for k, v in DIFFUSION.items()]
    task = TASKS.get("dit")(load_mm_config(None, overrides), 1)
    batch = task.microbatches(1, 0)[0]
    seen = {}
    task.model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    loss, _ = task.loss(batch, torch.zeros(2))
    loss.backward()
    ours = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in task.model.named_parameters()}
    expected, grads = _reference(run[0], task, batch)
    errors = {
        n: float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items() if g is not None
    }
    return {
        "family": task.family.key,
        "loss": float(loss.detach()),
        "expected": expected,
        "grad_error": max(errors.values()),
        "worst": max(errors, key=errors.get),
        "same_unused": sorted(n for n, g in grads.items() if g is None)
        == sorted(n for n, g in ours.items() if g is None),
        "nonzero": sum(bool(g.abs().max() > 0) for g in grads.values() if g is not None),
        "params": len(grads),
        "indices": batch.draw.indices.tolist(),
        "dropped": int(batch.draw.drop.sum()),
        "tokens": seen["hidden_states"].shape[1],
        "img_shapes": seen["img_shapes"],
    }


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_qwen_image_edit_loss_and_gradients_equal_diffusers_reference(tmp_path, zero_cond_t) -> None:
    # zero_cond_t (Qwen-Image-Edit-2511's config): the model gives the source tokens timestep 0 itself, from img_shapes
    run = _write_run(tmp_path / "edit", zero_cond_t=zero_cond_t)
    assert dit_family_of(run[0]).key == EDIT  # picked by the pipeline's model_index.json
    result = launch(_parity, (run,))
    print(
        f"Qwen-Image-Edit zero_cond_t={zero_cond_t} {DIFFUSION}: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative "
        f"gradient error {result['grad_error']:.1e} ({result['worst']}) over {result['params']} parameters "
        f"({result['nonzero']} nonzero), timesteps {result['indices']}, dropped {result['dropped']}, tokens {result['tokens']}"
    )
    assert result["family"] == EDIT and result["same_unused"]
    assert result["tokens"] == 4 + 6 and result["img_shapes"][0] == [(1, 2, 2), (1, 3, 2)]
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
    # diffusers' t / 1000 differs from our grid's sigma by up to an ulp (as in the Qwen-Image test)
    assert result["grad_error"] < 5e-5
    assert result["nonzero"] > result["params"] // 2
    assert 0 < result["dropped"] < 3  # each sample's own null text and real texts in one microbatch


def test_qwen_image_edit_without_source_latents_names_the_fix() -> None:
    family = DIT_FAMILIES.get(EDIT)
    with pytest.raises(ValueError, match="give --image SRC to generate, or `condition_image`"):
        family.model_inputs(family.tiny_config, torch.zeros(1, 4, 4, 4), torch.ones(1), torch.ones(1, 2, 64), None, 1.0)


def test_qwen_image_edit_text_dropout_without_null_texts_names_the_fix(tmp_path) -> None:
    run = _write_run(tmp_path / "edit", null_text=False)
    overrides = [f"model.path={run[0]}", f"data.features={run[1]}", "diffusion.text_dropout=0.1"]
    with pytest.raises(ValueError, match=r"lacks; extract features with the same diffusion.text_dropout, or set"):
        launch(_first_batch, (load_mm_config(None, overrides),))


def _first_batch(config) -> None:
    TASKS.get("dit")(config, 1).microbatches(1, 0)


def _sp_overrides(run, sp: int, *extra: str) -> list[str]:
    return [
        f"model.path={run[0]}",
        f"data.features={run[1]}",
        f"data.text_len={TEXT_LEN}",
        "train.precision=fp32",
        "train.micro_batch_size=2",
        "diffusion.timestep_sampling=logit_normal",
        "logging.progress=false",
        f"parallel.ulysses_parallel_size={sp}",
        *extra,
    ]


def _sp_sample(model_dir) -> dict:
    """Latents sampled with true CFG without and then with sequence parallelism (the same model, noise, texts and
    source latents)."""
    import torch.distributed as dist

    from mindspeed_mm.diffusion.sampler import build_scheduler, sample_latents
    from mindspeed_mm.models.dit import load_dit
    from mindspeed_mm.models.dit_parallel import apply_sequence_parallel

    family = DIT_FAMILIES.get(EDIT)
    model = load_dit(model_dir, family).eval()
    gen = torch.Generator().manual_seed(3)
    noise, source = torch.randn(2, 4, 4, 4, generator=gen), torch.randn(2, 4, 6, 4, generator=gen)
    text, negative = torch.randn(2, 8, 64, generator=gen), torch.randn(2, 8, 64, generator=gen)
    text[0, 5:] = 0  # a masked conditional text

    def sample() -> torch.Tensor:
        conditions = {"image_latents": source}
        return sample_latents(
            model, family, build_scheduler(family), noise, text, 3, None, negative, None, 4.0, conditions=conditions
        )

    one = sample()
    parallel = apply_sequence_parallel(model, family.sequence_plan, dist.group.WORLD)
    two = sample()
    return {"one": one.numpy(), "two": two.numpy(), "calls": parallel.calls}


def _sp2(rank: int, world: int, run, even) -> dict:
    from tests.mm.trainer.test_dit_sequence_parallel import _step

    ring = _step(_sp_overrides(even, 2, "parallel.context_parallel_algo=megatron_cp_algo"))
    return {"ulysses": _step(_sp_overrides(run, 2)), "sample": _sp_sample(run[0]), "ring": ring}


def _sp1_both(run, even) -> dict:
    return {"run": _sp1(run), "even": _sp1(even)}


def _sp1(run) -> dict:
    from tests.mm.trainer.test_dit_sequence_parallel import _step

    return _step(_sp_overrides(run, 1))


@pytest.mark.distributed
@pytest.mark.slow  # two spawned gloo ranks: 17-39 s wall alone at load 5-10 (the ranks start up), 7.6 s after another spawn
def test_qwen_image_edit_sp2_equals_sp1(tmp_path) -> None:
    """Two gloo Ulysses ranks split the joint sequence of 4 target and 6 source image tokens (5 each) and the masked
    texts: the training step's loss and every gradient equal one rank's, and sampling with true CFG (3 steps) equals
    the unsplit model's. Ring attention (``megatron_cp_algo``) with masked texts of 2 and 4 tokens too (it needs
    every share as its layout gives it, as for Qwen-Image: uneven text shares are refused with that message)."""
    from mindspeed.testing.distributed import run_distributed
    from tests.mm.trainer.test_dit_sequence_parallel import _close_grads

    run = _write_run(tmp_path / "edit")
    # texts of 2 and 4 tokens (a microbatch cuts to 4, masked): text and image shares even, as ring attention needs
    even = _write_run(tmp_path / "even", text_lengths=(2, 4))
    ones = launch(_sp1_both, (run, even))
    two = run_distributed(_sp2, 2, run, even, timeout=600)
    for algo, one in (("ulysses", ones["run"]), ("ring", ones["even"])):
        b = two[0][algo]
        assert b["loss"] == pytest.approx(one["loss"], rel=1e-5) and b["calls"] == 2, algo
        worst = _close_grads(one, b, 1e-5, f"qwen-image-edit sp2 {algo}")
        print(f"Qwen-Image-Edit SP2 {algo}: loss {b['loss']:.6f} (SP1 {one['loss']:.6f}), worst gradient {worst:.1e}")
        assert len(one["grads"]) > 60
    assert two[0]["ring"]["masked"] == 2  # the text mask travelled with the keys in both blocks
    sample = two[0]["sample"]
    np.testing.assert_allclose(sample["two"], sample["one"], rtol=0, atol=1e-5 * np.abs(sample["one"]).max())
    assert sample["calls"] == 2 * 3 * 2  # 2 blocks, 3 steps, conditional and unconditional
    np.testing.assert_array_equal(two[1]["sample"]["two"], sample["two"])
    print(f"Qwen-Image-Edit SP2 sampling: max |SP2 - SP1| {float(np.abs(sample['two'] - sample['one']).max()):.1e}")


def _train_lora(root, run) -> None:
    from mindspeed_mm.trainer.loop import train

    overrides = [
        f"model.path={run[0]}",
        f"data.features={run[1]}",
        f"data.text_len={TEXT_LEN}",
        "train.precision=fp32",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.lr=0.05",
        "logging.progress=false",
        "lora.target_modules=[default]",
        "lora.r=4",
        "lora.alpha=8",
        f"lora.save_peft={root / 'lora'}",
        f"checkpoint.save_hf={root / 'merged'}",
        f"checkpoint.save={root / 'ckpt'}",
    ]
    train(load_mm_config(None, overrides))


def _edit_output(model) -> torch.Tensor:
    family = DIT_FAMILIES.get(EDIT)
    gen = torch.Generator().manual_seed(3)
    latents, source = torch.randn(2, 4, 4, 4, generator=gen), torch.randn(2, 4, 6, 4, generator=gen)
    text = torch.randn(2, 8, 64, generator=gen)
    text[1, 5:] = 0
    inputs = family.model_inputs(model.config, latents, torch.tensor([0.3, 0.8]), text, None, 1.0, image_latents=source)
    with torch.no_grad():
        return family.prediction(model.eval()(**inputs), tuple(latents.shape))


def test_qwen_image_edit_lora_loads_in_the_edit_pipeline(tmp_path, capsys) -> None:
    """2 LoRA steps (r 4, alpha 8, Qwen-Image's default targets) on the edit family: ``lora.save_peft`` loaded by
    ``QwenImageEditPipeline.load_lora_weights`` and the merged ``checkpoint.save_hf`` give the run's prediction."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageTransformer2DModel

    from mindspeed_mm.config import MMLoraConfig
    from mindspeed_mm.models.dit import load_dit
    from mindspeed_mm.models.lora import apply_lora
    from tests.mm.models.test_dit_lora import _state

    family = DIT_FAMILIES.get(EDIT)
    run = _write_run(tmp_path / "edit")
    root = tmp_path / "runs"
    launch(_train_lora, (root, run))
    ours = load_dit(run[0], family)
    apply_lora(ours, MMLoraConfig(target_modules=["default"], r=4, alpha=8.0), family)
    saved = _state(root / "ckpt" / "step_00000002", tmp_path / "lora.pt")["model"]
    missing, unexpected = ours.load_state_dict(saved, strict=False)
    assert saved and not unexpected and all(".lora_" not in name for name in missing)
    expected = _edit_output(ours)
    pipe = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        processor=None,
        transformer=load_dit(run[0], family),
    )
    pipe.load_lora_weights(str(root / "lora"))
    diffusers_lora = _edit_output(pipe.transformer)
    merged, info = QwenImageTransformer2DModel.from_pretrained(root / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    merged = _edit_output(merged)
    base = _edit_output(load_dit(run[0], family))
    with capsys.disabled():
        print(
            f"Qwen-Image-Edit LoRA: |load_lora_weights - run| {float((diffusers_lora - expected).abs().max()):.2e}, "
            f"|merged - run| {float((merged - expected).abs().max()):.2e}, |run - base| "
            f"{float((expected - base).abs().max()):.2e}"
        )
    torch.testing.assert_close(diffusers_lora, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
    assert float((expected - base).abs().max()) > 1e-2  # the LoRA trained
