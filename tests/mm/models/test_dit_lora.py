"""LoRA, conversion and EMA of diffusion transformers, against diffusers.

One module fixture trains the tiny Wan and FLUX transformers for 2 steps with LoRA on the
family's default targets (r 4, alpha 8), and the tiny Wan with full fine-tuning and
``train.ema=0.5`` (twice: exporting the averages, and with ``checkpoint.export_ema=false``).

- LoRA: the run's ``lora.save_peft`` (``pytorch_lora_weights.safetensors``) loaded by diffusers'
  own ``WanPipeline.load_lora_weights`` / ``FluxPipeline.load_lora_weights`` gives the transformer
  output of the run's model (the last DCP checkpoint in the base model with the same LoRA layers)
  within 1e-5, and ``WanPipeline``'s sampled latents equal our sampler's with the run's model; the
  merged ``checkpoint.save_hf`` gives the same output; the LoRA moved the output.
- convert: diffusers -> DCP -> diffusers is bit-identical (names, dtypes, bytes, config.json) for
  Wan and FLUX, written as ``diffusion_pytorch_model.safetensors`` and loaded by
  ``WanPipeline.from_pretrained``; dcp -> hf of the LoRA run equals its merged export bit for bit,
  dcp -> lora its adapter, lora -> hf (merge) the merged export, lora -> dcp the checkpoint's factors
  over the base's weights.
- EMA: convert and generate's checkpoint loader give the checkpoint's moving averages by default
  (equal to the run's export), the raw weights with ``--no-ema`` / ``ema=False`` (equal to the
  ``export_ema=false`` run's export).
- Bad input: one line on standard error, exit status 2, nothing written.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mindspeed.launch import launch
from mindspeed_mm.cli import main
from mindspeed_mm.config import MMLoraConfig, load_mm_config
from mindspeed_mm.models.dit import DIT_FAMILIES, load_dit
from mindspeed_mm.models.lora import apply_lora
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.loop import train

WAN, FLUX = "WanTransformer3DModel", "FluxTransformer2DModel"
LORA = MMLoraConfig(target_modules=["default"], r=4, alpha=8.0)
STEP = "step_00000002"


def _overrides(run: tuple[Path, Path], **extra) -> list[str]:
    values = {
        "model.path": run[0],
        "data.features": run[1],
        "data.text_len": 8,
        "train.precision": "fp32",
        "train.steps": 2,
        "train.micro_batch_size": 2,
        "train.lr": 0.05,
        "logging.progress": "false",
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def _train_all(root: Path, runs: dict) -> None:
    for arch in (WAN, FLUX):
        out = root / arch
        lora = {"lora.target_modules": "[default]", "lora.r": 4, "lora.alpha": 8}
        paths = {"lora.save_peft": out / "lora", "checkpoint.save_hf": out / "merged", "checkpoint.save": out / "ckpt"}
        train(load_mm_config(None, _overrides(runs[arch], **lora, **paths)))
    ema = {"train.ema": 0.5, "train.lr": 0.01}
    paths = {"checkpoint.save": root / "ema" / "ckpt", "checkpoint.save_hf": root / "ema" / "hf"}
    train(load_mm_config(None, _overrides(runs[WAN], **ema, **paths)))
    raw = {"checkpoint.save_hf": root / "ema" / "hf_raw", "checkpoint.export_ema": "false"}
    train(load_mm_config(None, _overrides(runs[WAN], **ema, **raw)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("dit-lora")
    runs = {arch: write_tiny_dit_run(root / "base" / arch, arch) for arch in (WAN, FLUX)}
    launch(_train_all, (root, runs))
    return root, runs


def _state(checkpoint: Path, scratch: Path) -> dict:
    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=False)


def _inputs(model, arch: str) -> dict:
    family = DIT_FAMILIES.get(arch)
    gen = torch.Generator().manual_seed(3)
    shape = (2, 4, 3, 4, 4) if arch == WAN else (2, 4, 4, 4)
    pooled = torch.randn(2, 32, generator=gen) if family.needs_pooled else None
    text = torch.randn(2, 8, 16 if arch == WAN else 32, generator=gen)
    sigmas = torch.tensor([0.3, 0.8])
    return family.model_inputs(model.config, torch.randn(shape, generator=gen), sigmas, text, pooled, 3.5)


def _output(model, arch: str) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**_inputs(model, arch))[0]


def _run_model(model_dir: Path, checkpoint: Path, scratch: Path, arch: str):
    """The run's model: the base with the run's LoRA layers and the last checkpoint's factors (all it holds)."""
    model = load_dit(model_dir, DIT_FAMILIES.get(arch))
    apply_lora(model, LORA, DIT_FAMILIES.get(arch))
    saved = _state(checkpoint, scratch)["model"]
    assert saved and all(".lora_" in name for name in saved)
    missing, unexpected = model.load_state_dict(saved, strict=False)
    assert not unexpected and all(".lora_" not in name for name in missing)
    return model


def _pipeline(arch: str, transformer):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, WanPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    if arch == WAN:
        return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler, transformer=transformer)
    return FluxPipeline(
        scheduler=scheduler,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )


def test_lora_export_loads_in_diffusers_pipelines(trained, tmp_path) -> None:
    from mindspeed_mm.diffusion.sampler import sample_latents

    root, runs = trained
    for arch in (WAN, FLUX):
        family, out = DIT_FAMILIES.get(arch), root / arch
        ours = _run_model(runs[arch][0], out / "ckpt" / STEP, tmp_path / f"{arch}.pt", arch)
        expected = _output(ours, arch)
        pipe = _pipeline(arch, load_dit(runs[arch][0], family))
        pipe.load_lora_weights(str(out / "lora"))
        assert pipe.transformer.peft_config["default_0"].lora_alpha == 8.0
        diffusers_lora = _output(pipe.transformer, arch)
        merged = _output(family.load_class().from_pretrained(out / "merged"), arch)
        base = _output(load_dit(runs[arch][0], family), arch)
        print(
            f"{arch}: |load_lora_weights - run| {float((diffusers_lora - expected).abs().max()):.2e}, "
            f"|merged - run| {float((merged - expected).abs().max()):.2e}, "
            f"|run - base| {float((expected - base).abs().max()):.2e}"
        )
        torch.testing.assert_close(diffusers_lora, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
        assert float((expected - base).abs().max()) > 1e-2  # the LoRA trained
        if arch == WAN:  # the pipeline's own sampling loop with the loaded LoRA, against ours with the run's model
            gen = torch.Generator().manual_seed(4)
            latents, text = torch.randn(1, 4, 3, 4, 4, generator=gen), torch.randn(1, 8, 16, generator=gen)
            scheduler = copy.deepcopy(pipe.scheduler)
            theirs = pipe(
                prompt_embeds=text,
                latents=latents,
                height=32,
                width=32,
                num_frames=9,
                num_inference_steps=3,
                guidance_scale=1.0,
                output_type="latent",
            ).frames
            mine = sample_latents(ours, family, scheduler, latents, text, 3)
            print(f"{arch}: |WanPipeline sample - ours| {float((theirs - mine).abs().max()):.2e}")
            torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)


def _convert(capsys, load: str, save: str, load_dir: Path, save_dir: Path, *extra: str) -> tuple[int, str]:
    code = main(
        [
            "convert",
            "--load-format",
            load,
            "--save-format",
            save,
            "--load-dir",
            str(load_dir),
            "--save-dir",
            str(save_dir),
            "--no-progress",
            *extra,
        ]
    )
    return code, capsys.readouterr().err


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "diffusion_pytorch_model.safetensors")


def _same(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> None:
    assert set(one) == set(two)
    for name, value in one.items():
        assert value.dtype == two[name].dtype and torch.equal(value, two[name]), name


def test_convert_round_trips_and_lora(capsys, trained, tmp_path) -> None:
    from diffusers import WanPipeline

    root, runs = trained
    for arch in (WAN, FLUX):
        base = runs[arch][0]
        assert _convert(capsys, "hf", "dcp", base, tmp_path / arch / "dcp")[0] == 0
        assert (
            _convert(capsys, "dcp", "hf", tmp_path / arch / "dcp", tmp_path / arch / "hf", "--base-dir", str(base))[0]
            == 0
        )
        back = tmp_path / arch / "hf"
        assert sorted(p.name for p in back.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
        assert (back / "config.json").read_bytes() == (base / "config.json").read_bytes()
        _same(_weights(back), _weights(base))
        _same(_state(tmp_path / arch / "dcp", tmp_path / f"{arch}.pt")["model"], _weights(base))
    # the round trip's directory is a pipeline's transformer folder diffusers loads
    pipe_dir = tmp_path / "wan-pipeline"
    _pipeline(WAN, load_dit(runs[WAN][0], DIT_FAMILIES.get(WAN))).save_pretrained(pipe_dir)
    shutil.rmtree(pipe_dir / "transformer")
    shutil.copytree(tmp_path / WAN / "hf", pipe_dir / "transformer")
    loaded = WanPipeline.from_pretrained(pipe_dir, vae=None, text_encoder=None, tokenizer=None, transformer_2=None)
    _same(loaded.transformer.state_dict(), _weights(runs[WAN][0]))

    for arch in (WAN, FLUX):  # LoRA: merge from the checkpoint, the adapter, and back
        base, out, work = runs[arch][0], root / arch, tmp_path / arch
        merged = _weights(out / "merged")
        assert _convert(capsys, "dcp", "hf", out / "ckpt", work / "merged", "--base-dir", str(base))[0] == 0
        _same(_weights(work / "merged"), merged)
        assert _convert(capsys, "dcp", "lora", out / "ckpt", work / "lora")[0] == 0
        _same(
            load_file(work / "lora" / "pytorch_lora_weights.safetensors"),
            load_file(out / "lora" / "pytorch_lora_weights.safetensors"),
        )
        with safe_open(str(work / "lora" / "pytorch_lora_weights.safetensors"), "pt") as handle:
            metadata = json.loads(handle.metadata()["lora_adapter_metadata"])
        assert metadata["transformer.r"] == 4 and metadata["transformer.lora_alpha"] == 8.0
        assert _convert(capsys, "lora", "hf", out / "lora", work / "lora_merged", "--base-dir", str(base))[0] == 0
        _same(_weights(work / "lora_merged"), merged)
        assert _convert(capsys, "lora", "dcp", out / "lora", work / "lora_dcp", "--base-dir", str(base))[0] == 0
        rebuilt = _state(work / "lora_dcp", tmp_path / "lora_dcp.pt")["model"]
        run = _state(out / "ckpt" / STEP, tmp_path / "run.pt")["model"]  # the factors
        _same({name: rebuilt[name] for name in run}, run)
        base_weights = _weights(base)
        for name, value in rebuilt.items():  # the rest: the base's weights under the LoRA model's names
            if name not in run:
                assert torch.equal(value, base_weights[name.replace(".base_layer.", ".")]), name


def test_ema_weights_are_picked_by_default(capsys, trained, tmp_path) -> None:
    from mindspeed_mm.inference.dit_pipeline import _load_dcp

    root, runs = trained
    state = _state(root / "ema" / "ckpt" / STEP, tmp_path / "ema.pt")
    averages = {name: entry["ema"] for name, entry in state["optim"]["state"].items()}
    raw = state["model"]
    assert set(averages) == set(raw) and not any(torch.equal(averages[n], raw[n]) for n in raw if raw[n].ndim > 1)
    _same(_weights(root / "ema" / "hf"), averages)  # the training's export: the averages
    _same(_weights(root / "ema" / "hf_raw"), raw)  # checkpoint.export_ema=false: the raw weights
    base = runs[WAN][0]
    code, err = _convert(capsys, "dcp", "hf", root / "ema" / "ckpt", tmp_path / "ema_hf", "--base-dir", str(base))
    assert code == 0, err
    _same(_weights(tmp_path / "ema_hf"), averages)
    code, err = _convert(
        capsys, "dcp", "hf", root / "ema" / "ckpt", tmp_path / "raw_hf", "--base-dir", str(base), "--no-ema"
    )
    assert code == 0, err
    _same(_weights(tmp_path / "raw_hf"), raw)
    family = DIT_FAMILIES.get(WAN)
    _same(_load_dcp(root / "ema" / "ckpt" / STEP, base, family).state_dict(), averages)
    _same(_load_dcp(root / "ema" / "ckpt" / STEP, base, family, ema=False).state_dict(), raw)
    # a LoRA run's checkpoint: generate's loader merges the factors as the export does
    _same(_load_dcp(root / WAN / "ckpt" / STEP, base, family).state_dict(), _weights(root / WAN / "merged"))


def test_bad_input_is_one_line_exit_2_and_nothing_written(capsys, trained, tmp_path) -> None:
    root, runs = trained
    wan, flux = runs[WAN][0], runs[FLUX][0]
    extra = tmp_path / "extra-hf"  # a diffusers directory with a tensor its model lacks
    shutil.copytree(wan, extra)
    tensors = _weights(extra)
    tensors["blocks.9.attn1.to_q.weight"] = tensors["blocks.0.attn1.to_q.weight"].clone()
    save_file(tensors, extra / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    stray = tmp_path / "stray-lora"  # a text-encoder factor in a transformer LoRA
    stray.mkdir()
    factors = load_file(root / WAN / "lora" / "pytorch_lora_weights.safetensors")
    factors["text_encoder.layer.0.q.lora_A.weight"] = torch.zeros(4, 16)
    save_file(factors, stray / "pytorch_lora_weights.safetensors")
    cases = [
        (("hf", "dcp", extra), (), "matching no tensor of WanTransformer3DModel: blocks.9.attn1.to_q.weight"),
        (
            ("dcp", "hf", root / "ema" / "ckpt"),
            ("--base-dir", str(flux)),
            "matching no tensor of FluxTransformer2DModel",
        ),
        (("dcp", "hf", root / WAN / "ckpt"), ("--base-dir", str(flux)), "is not a linear of FluxTransformer2DModel"),
        (("lora", "hf", stray), ("--base-dir", str(wan)), "not LoRA factors of the transformer"),
        (("lora", "hf", root / WAN / "merged"), ("--base-dir", str(wan)), "has no pytorch_lora_weights.safetensors"),
        (("lora", "hf", root / WAN / "lora"), ("--base-dir", str(flux)), "is not a linear of FluxTransformer2DModel"),
        (("dcp", "lora", root / "ema" / "ckpt"), (), "holds no LoRA factors"),
    ]
    for (load, save, source), flags, message in cases:
        target = tmp_path / "out"
        code, err = _convert(capsys, load, save, source, target, *flags)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (load, save, err)
        assert not target.exists() and not list(tmp_path.glob(".out.*")), err
    with pytest.raises(ValueError, match="no linear of WanTransformer3DModel inside lora.parts=.* has that name"):
        apply_lora(load_dit(wan, DIT_FAMILIES.get(WAN)), MMLoraConfig(target_modules=["q_proj"]), DIT_FAMILIES.get(WAN))
