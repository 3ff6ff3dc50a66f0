"""``mindspeed-mm train``'s ``checkpoint.save_hf`` says the dtype it holds, so transformers loads what was trained.

A tiny Qwen2.5-VL whose directory is bfloat16 trains 2 fp32 steps (lr 0.05: updates bfloat16
cannot hold) with a validation pass after the last one. The export, loaded with transformers'
defaults (no dtype: ``config.json``'s), is float32, holds exactly the tensors written, and its
per-token loss on the validation batch equals the trainer's (rel 1e-6). With
``checkpoint.save_hf_dtype=bfloat16`` the tensors are bfloat16 and the config says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.data import read_mllm_files
from mindspeed_mm.data.preprocess import EncodeSettings, Processing
from mindspeed_mm.models import family_of, load_model, load_processing
from mindspeed_mm.trainer.loop import train

SAMPLES = 4  # eval.iters=1 with a global batch of 4: the first 4 samples of the validation file


def _evals(config):
    return train(config).evals


def _bf16_source(model_dir: Path, target: Path) -> Path:
    """``model_dir`` rewritten in bfloat16 (weights and config), its processor files copied."""
    load_model(model_dir, family_of(model_dir), "sdpa").to(torch.bfloat16).save_pretrained(target)
    for item in model_dir.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and not (target / item.name).exists():
            shutil.copy2(item, target / item.name)
    return target


def _run(source: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    overrides = [
        f"model.path={source}",
        f"data.files=[{data}]",
        "data.shuffle=false",
        "train.micro_batch_size=4",
        "train.precision=fp32",
        "train.loss_type=per_token",
        "train.lr=0.05",
        "logging.progress=false",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
        f"checkpoint.save_hf={out}",
        *extra,
    ]
    return launch(_evals, (load_mm_config(None, overrides),))


def _per_token_loss(model, model_dir: Path, data: Path) -> float:
    family = family_of(model_dir)
    processing = Processing(*load_processing(model_dir, 28 * 28, 112 * 112), family)
    total = count = 0.0
    for sample in read_mllm_files([str(data)])[:SAMPLES]:
        enc = processing.encode(sample, EncodeSettings(cutoff_len=1024))
        inputs = {"input_ids": enc.input_ids[None], "labels": enc.labels[None], "use_cache": False}
        inputs.update(enc.vision, mm_token_type_ids=enc.mm_token_type_ids[None])
        with torch.no_grad():
            total += float(model(**inputs).loss) * enc.num_label_tokens
        count += enc.num_label_tokens
    return total / count


def _same_name(loaded: str, on_disk: str) -> bool:
    return loaded == on_disk or loaded.endswith("." + on_disk.split(".", 1)[-1])


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _file_dtypes(path: Path) -> set[str]:
    from safetensors import safe_open

    out = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            out |= {f.get_slice(k).get_dtype() for k in f.keys()}
    return out


def test_vlm_export_loads_as_trained_and_save_hf_dtype_casts(tiny_vlm, tmp_path) -> None:
    from safetensors.torch import load_file

    model_dir, data = tiny_vlm
    source = _bf16_source(model_dir, tmp_path / "bf16")
    assert _config(source)["dtype"] == "bfloat16"
    evals = _run(source, data, tmp_path / "hf", "train.steps=2", f"data.valid_files=[{data}]", "eval.iters=1")
    assert _config(tmp_path / "hf")["dtype"] == "float32" and _file_dtypes(tmp_path / "hf") == {"F32"}
    family = family_of(source)
    model = family.load_class().from_pretrained(tmp_path / "hf").eval()  # transformers' defaults: dtype auto
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    written = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        written.update(load_file(shard))
    loaded = model.state_dict()
    # On disk the hub's names (``model.layers.0...``), in the model transformers' own (``model.language_model...``).
    same = [k for k, v in written.items() if any(torch.equal(loaded[n], v) for n in loaded if _same_name(n, k))]
    assert len(same) == len(written), sorted(set(written) - set(same))[:5]
    moved = [v for v in written.values() if not torch.equal(v, v.bfloat16().float())]
    assert moved, "no weight left bf16's grid: nothing is proven"
    assert _per_token_loss(model, source, data) == pytest.approx(evals[-1]["loss"], rel=1e-6)

    _run(source, data, tmp_path / "hf-bf16", "train.steps=1", "checkpoint.save_hf_dtype=bfloat16")
    config = _config(tmp_path / "hf-bf16")
    assert config["dtype"] == "bfloat16" and config["text_config"].get("dtype", "bfloat16") == "bfloat16"
    assert _file_dtypes(tmp_path / "hf-bf16") == {"BF16"}
    assert {p.dtype for p in family.load_class().from_pretrained(tmp_path / "hf-bf16").parameters()} == {torch.bfloat16}
