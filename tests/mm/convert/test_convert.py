"""``mindspeed-mm convert``: round trips are bit-identical, bad input is one line and exit 2 with nothing written.

- hf -> dcp -> hf gives the source's tensors (names, dtypes, bytes) for Qwen2.5-VL, Qwen3-VL and
  InternVL (whose hub names differ from the module names everywhere), the result loads in
  transformers with no missing, unexpected or mismatched keys, and the DCP holds the model's own
  state dict (module names) bit for bit.
- From the LoRA run's checkpoint (tests/mm/conftest.py: tiny_lora_run): dcp -> peft (alpha from
  the adapter_config.json the run keeps next to its checkpoints) equals the run's ``lora.save_peft`` adapter; dcp -> hf (merged) and peft -> hf (merge onto the base)
  equal the run's merged ``checkpoint.save_hf`` (``--dtype bfloat16``: its bf16 cast); peft -> dcp rebuilds the checkpoint's model
  state bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mindspeed.checkpointing.safetensors_io import HFCheckpoint
from mindspeed_mm.cli import main
from mindspeed_mm.models import family_of, load_model
from mindspeed_mm.models.lora import is_factor


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


def _hf(directory: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(directory)
    return {name: checkpoint.read(name).clone() for name in checkpoint.tensors}


def _dcp(directory: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(directory, scratch)
    return torch.load(scratch, weights_only=False)["model"]


def _same(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> None:
    assert set(one) == set(two)
    for name, value in one.items():
        assert value.dtype == two[name].dtype and torch.equal(value, two[name]), name


def test_round_trips_are_bit_identical(capsys, tiny_vlm, tiny_qwen3_vl, tiny_internvl, tiny_lora_run, tmp_path) -> None:
    import transformers

    for model_dir in (tiny_vlm[0], tiny_qwen3_vl[0], tiny_internvl[0]):
        out = tmp_path / model_dir.name
        assert _convert(capsys, "hf", "dcp", model_dir, out / "dcp")[0] == 0
        assert _convert(capsys, "dcp", "hf", out / "dcp", out / "hf", "--base-dir", str(model_dir))[0] == 0
        _same(_hf(model_dir), _hf(out / "hf"))
        architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
        _, info = getattr(transformers, architecture).from_pretrained(out / "hf", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], architecture
        _same(load_model(model_dir, family_of(model_dir)).state_dict(), _dcp(out / "dcp", out / "dcp.pt"))
        assert (out / "hf" / "tokenizer.json").is_file() and (out / "hf" / "chat_template.jinja").is_file()

    run, base = tiny_lora_run, tiny_vlm[0]
    lora = ("--lora-alpha", "8", "--base-dir", str(base))
    # SAVE: its newest step; alpha from the adapter_config.json the run wrote there
    assert _convert(capsys, "dcp", "peft", run / "ckpt", tmp_path / "peft", "--base-dir", str(base))[0] == 0
    _same(
        load_file(run / "peft" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["lora_alpha"] == 8
    from peft import PeftModel  # the converted adapter (targets as a list of module names) loads in peft

    loaded = PeftModel.from_pretrained(load_model(base, family_of(base)), tmp_path / "peft")
    assert len(loaded.targeted_module_names) == 6
    assert _convert(capsys, "dcp", "hf", run / "ckpt" / "step_00000002", tmp_path / "merged", *lora)[0] == 0
    _same(_hf(run / "merged"), _hf(tmp_path / "merged"))
    assert (
        _convert(capsys, "dcp", "hf", run / "ckpt", tmp_path / "bf16", "--dtype", "bfloat16", "--base-dir", str(base))[
            0
        ]
        == 0
    )
    _same(
        {name: t.to(torch.bfloat16) for name, t in _hf(run / "merged").items()}, _hf(tmp_path / "bf16")
    )  # merged in fp32
    assert _convert(capsys, "peft", "hf", tmp_path / "peft", tmp_path / "merged2", "--base-dir", str(base))[0] == 0
    _same(_hf(run / "merged"), _hf(tmp_path / "merged2"))
    assert _convert(capsys, "peft", "dcp", tmp_path / "peft", tmp_path / "dcp", "--base-dir", str(base))[0] == 0
    trained, converted = (
        _dcp(run / "ckpt" / "step_00000002", tmp_path / "a.pt"),
        _dcp(tmp_path / "dcp", tmp_path / "b.pt"),
    )
    assert trained and all(map(is_factor, trained))  # a LoRA run checkpoints its factors alone
    _same(trained, {name: t for name, t in converted.items() if is_factor(name)})
    base_state = load_model(base, family_of(base)).state_dict()  # the rest is the base's
    assert all(
        torch.equal(t, base_state[name.replace(".base_layer.", ".")])
        for name, t in converted.items()
        if not is_factor(name)
    )


def test_bad_input_is_one_line_exit_2_and_nothing_written(
    capsys, tiny_vlm, tiny_internvl, tiny_lora_run, tmp_path
) -> None:
    base, run = tiny_vlm[0], tiny_lora_run
    full = tmp_path / "full-dcp"
    assert _convert(capsys, "hf", "dcp", base, full)[0] == 0
    odd = tmp_path / "odd-hf"  # one tensor renamed: one unknown, one missing
    shutil.copytree(base, odd)
    tensors = load_file(odd / "model.safetensors")
    tensors["extra.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, odd / "model.safetensors", metadata={"format": "pt"})
    bare = tmp_path / "bare-dcp"  # a LoRA checkpoint away from the run's adapter_config.json
    shutil.copytree(run / "ckpt" / "step_00000002", bare)
    damaged = tmp_path / "damaged-dcp"
    shutil.copytree(run / "ckpt" / "step_00000002", damaged)
    data = sorted(damaged.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    truncated = tmp_path / "truncated-hf"
    shutil.copytree(base, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    dora = tmp_path / "dora"
    shutil.copytree(run / "peft", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    cases = [
        (("hf", "dcp", tmp_path / "nowhere"), (), "--load-dir", "is not a directory"),
        (("hf", "peft", base), (), "--save-format peft", "is not a conversion; use one of dcp -> hf"),
        (("dcp", "hf", run / "ckpt"), (), "dcp -> hf", "needs --base-dir"),
        (
            ("dcp", "hf", bare),
            ("--base-dir", str(base)),
            "LoRA factors on 6 linears and no adapter_config.json",
            "pass --lora-alpha",
        ),
        (
            ("dcp", "peft", run / "ckpt"),
            ("--lora-alpha", "16"),
            "--lora-alpha 16.0 differs from the run's lora_alpha 8.0",
        ),
        (
            ("dcp", "hf", full),
            ("--base-dir", str(tiny_internvl[0])),
            "matching no tensor of InternVLForConditional",
            "model.visual.blocks.0.attn.proj.bias",
        ),
        (
            ("hf", "dcp", odd),
            (),
            "has 1 tensor matching no tensor of Qwen2_5_VLForConditionalGeneration: extra.weight; ",
            "lacks 1 tensor of Qwen2_5_VLForConditionalGeneration: lm_head.weight",
        ),
        (("dcp", "hf", damaged), ("--base-dir", str(base), "--lora-alpha", "8"), "incomplete or damaged", ""),
        (("hf", "dcp", truncated), (), "is truncated", ""),
        (("peft", "hf", dora), ("--base-dir", str(base)), "use_dora=True is not supported", ""),
        (("dcp", "peft", full), ("--lora-alpha", "8"), "holds no LoRA factors", ""),
        (("dcp", "hf", base), ("--base-dir", str(base)), "is not a DCP checkpoint", ""),
    ]
    for number, ((load, save, load_dir), extra, *fragments) in enumerate(cases):
        target = tmp_path / "out" / str(number)
        code, err = _convert(capsys, load, save, load_dir, target, *extra)
        assert code == 2, (number, err)
        assert err.count("\n") == 1 and err.startswith("mindspeed-mm: error: "), (number, err)
        assert all(fragment in err for fragment in fragments), (number, err)
        assert not target.exists(), number
    assert not list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else True  # no partial leftovers

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("keep")
    code, err = _convert(capsys, "hf", "dcp", base, kept)
    assert code == 2 and "is not empty; pass --overwrite" in err and [p.name for p in kept.iterdir()] == ["mine.txt"]
