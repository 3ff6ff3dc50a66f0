"""LoRA: targets by name inside parts; the PEFT adapter and the merged export reproduce the trained model.

MindSpeed-MM's seven targets adapt the language model only, for the three families (InternVL's
vision tower has q_proj / k_proj / v_proj too). The reference is the trained state itself: the last DCP checkpoint loaded into the base model
with the same LoRA layers. Its loss on the samples (computed by transformers, sample by sample)
must equal that of ``PeftModel.from_pretrained(base, save_peft)`` and that of the merged
``save_hf`` directory, and both, scored by transformers / peft on the held-out file, give the
run's final logged validation loss (``data.valid_files``); only the targeted weights differ from the base in the merged export, and
the checkpoint holds the factors alone (the frozen base is ``model.path``'s). (DP2 equals DP1
with LoRA: tests/mm/trainer/test_fsdp.py.) A run resumed from the step-1 checkpoint (the factors and
their optimizer state, over the base reloaded from ``model.path``) repeats step 2 exactly.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from mindspeed.launch import launch
from mindspeed_mm.config import MMLoraConfig, load_mm_config
from mindspeed_mm.data import encode_sample, read_mllm_files
from mindspeed_mm.models import family_of, load_model, load_processing
from mindspeed_mm.models.lora import apply_lora, is_factor
from mindspeed_mm.trainer.loop import train
from tests.core.metrics.readers import jsonl_series, mlflow_series

LORA = MMLoraConfig(
    target_modules=["q_proj", "v_proj", "qkv"], parts=["language_model", "vision_tower"], r=4, alpha=8.0
)


def _losses(model, encoded) -> list[float]:
    with torch.no_grad():
        return [
            float(
                model(
                    input_ids=s.input_ids[None],
                    labels=s.labels[None],
                    use_cache=False,
                    mm_token_type_ids=s.mm_token_type_ids[None],
                    **s.vision,
                ).loss
            )
            for s in encoded
        ]


def _valid_loss(model, encoded, micro: int) -> float:
    """``loss_type: default`` over a validation file: the mean of the token means of its microbatches of ``micro``
    consecutive samples, from transformers' per-sample losses (each a token mean)."""
    losses = _losses(model, encoded)
    means = []
    for start in range(0, len(encoded), micro):
        counts = [s.num_label_tokens for s in encoded[start : start + micro]]
        means.append(sum(loss * c for loss, c in zip(losses[start : start + micro], counts)) / sum(counts))
    return sum(means) / len(means)


def _train(config):
    return train(config)


MINDSPEED_MM_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_targets_by_name_inside_parts(tiny_vlm, tiny_qwen3_vl, tiny_internvl) -> None:
    for model_dir in (tiny_vlm[0], tiny_qwen3_vl[0], tiny_internvl[0]):  # 2 layers x 7 linears, language model only
        family = family_of(model_dir)
        adapted = apply_lora(load_model(model_dir, family), MMLoraConfig(target_modules=MINDSPEED_MM_TARGETS), family)
        assert len(adapted) == 14 and all(n.startswith("model.language_model.layers.") for n in adapted), adapted
    family = family_of(tiny_internvl[0])  # its vision tower has q_proj / k_proj / v_proj too: adapted when asked
    adapted = apply_lora(
        load_model(tiny_internvl[0], family), MMLoraConfig(target_modules=["q_proj"], parts=["vision_tower"]), family
    )
    assert adapted and all(n.startswith("model.vision_tower.") for n in adapted), adapted

    model_dir, _ = tiny_vlm
    family = family_of(model_dir)
    model = load_model(model_dir, family)
    adapted = apply_lora(model, MMLoraConfig(target_modules=["q_proj", "v_proj"], r=4), family)
    assert adapted and all(n.startswith("model.language_model.") and n.endswith(("q_proj", "v_proj")) for n in adapted)
    linears = dict(model.named_modules())
    expected = sum(4 * (linears[n].base_layer.in_features + linears[n].base_layer.out_features) for n in adapted)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    with pytest.raises(
        ValueError,
        match=r"no linear .* inside lora.parts=\['language_model'\] has that name; its "
        r"linears are named .*down_proj",
    ):
        apply_lora(load_model(model_dir, family), MMLoraConfig(target_modules=["qkv"]), family)
    with pytest.raises(ValueError, match="'vision' is not a part"):
        apply_lora(load_model(model_dir, family), MMLoraConfig(target_modules=["qkv"], parts=["vision"]), family)


def test_peft_adapter_and_merged_export_equal_the_trained_model(tiny_vlm, tiny_valid, tiny_lora_run, tmp_path) -> None:
    from peft import PeftModel
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_dir, data = tiny_vlm
    run = tiny_lora_run
    family = family_of(model_dir)
    tokenizer, processor = load_processing(model_dir, 784, 12544)
    encoded = [encode_sample(s, tokenizer, processor, family, 1024) for s in read_mllm_files([str(data)])]
    dcp_to_torch_save(run / "ckpt" / "step_00000002", tmp_path / "last.pt")
    state = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    trained = load_model(model_dir, family)  # the checkpoint holds the factors; the frozen rest is model.path's
    apply_lora(trained, LORA, family)
    assert state and all(map(is_factor, state))
    loaded = trained.load_state_dict(state, strict=False)
    assert not loaded.unexpected_keys and not any(map(is_factor, loaded.missing_keys))
    expected = _losses(trained, encoded)
    base = _losses(load_model(model_dir, family), encoded)
    assert max(abs(a - b) for a, b in zip(expected, base)) > 1e-2  # LoRA changed the model

    before = load_file(model_dir / "model.safetensors")

    recorded = json.loads((run / "ckpt" / "adapter_config.json").read_text())  # for convert: alpha
    assert recorded == json.loads((run / "peft" / "adapter_config.json").read_text()) and recorded["lora_alpha"] == 8
    peft_model = PeftModel.from_pretrained(load_model(model_dir, family), run / "peft")
    assert _losses(peft_model, encoded) == pytest.approx(expected, rel=1e-6, abs=0)
    merged, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(run / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert _losses(merged, encoded) == pytest.approx(expected, rel=1e-5, abs=0)

    # The run's last validation loss (5 held-out samples: microbatches of 4 and 1) is what the exports score.
    lines = (run / "ckpt" / "metrics.jsonl").read_text().splitlines()
    evals = [record for record in map(json.loads, lines) if record["kind"] == "eval"]
    assert [record["step"] for record in evals] == [1, 2]
    tokenizer, processor = load_processing(model_dir, 3136, 12544)  # the run's data.image_{min,max}_pixels
    held_out = [encode_sample(s, tokenizer, processor, family, 2048) for s in read_mllm_files([str(tiny_valid)])]
    scores = {"peft": _valid_loss(peft_model, held_out, 4), "merged": _valid_loss(merged, held_out, 4)}
    print(f"validation loss: run {evals[-1]['loss']:.6f} (step 1 {evals[0]['loss']:.6f}), exports {scores}")
    assert scores == pytest.approx({"peft": evals[-1]["loss"], "merged": evals[-1]["loss"]}, rel=1e-5, abs=0)
    assert evals[-1]["loss"] != pytest.approx(_valid_loss(load_model(model_dir, family), held_out, 4), rel=1e-3)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "ckpt" / "tensorboard"))
    events.Reload()  # the same numbers as TensorBoard's eval/loss
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in evals
    ]
    # logging.trackers also had MLflow: the same series, and the resolved recipe as the run's params.
    expected = jsonl_series(run / "ckpt" / "metrics.jsonl")
    series, params = mlflow_series((run / "mlruns").as_uri(), "mm-lora", ["eval/loss", "train/loss", "train/lr"])
    assert series == {key: expected[key] for key in series} and len(series["train/loss"]) == 2
    assert params["lora.r"] == "4" and params["model.path"] == str(model_dir)

    after = load_file(run / "merged" / "model.safetensors")
    assert set(before) == set(after)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.endswith(("q_proj.weight", "v_proj.weight", "qkv.weight")) for name in changed)


def test_lora_resume_repeats_the_run(tiny_vlm, tiny_lora_run, tmp_path) -> None:
    model_dir, data = tiny_vlm
    shutil.copytree(tiny_lora_run / "ckpt" / "step_00000001", tmp_path / "step_00000001")
    resumed = launch(
        _train,
        (
            load_mm_config(
                None,
                [
                    f"model.path={model_dir}",
                    f"data.files=[{data}]",
                    "train.steps=2",
                    "train.micro_batch_size=4",
                    "train.precision=fp32",
                    "train.lr=0.05",
                    "logging.progress=false",
                    "data.image_max_pixels=12544",
                    "lora.target_modules=[q_proj, v_proj, qkv]",
                    "lora.parts=[language_model, vision_tower]",
                    "lora.r=4",
                    "lora.alpha=8",
                    f"checkpoint.save={tmp_path}",
                ],
            ),
        ),
    )
    # the checkpoint holds the factors and their optimizer state only: the frozen base is model.path's
    saved = dcp.FileSystemReader(str(tmp_path / "step_00000001")).read_metadata().state_dict_metadata
    model_keys = [key.removeprefix("model.") for key in saved if key.startswith("model.")]
    moments = [key for key in saved if key.startswith("optim.state.")]
    assert model_keys and all(map(is_factor, model_keys))
    assert len(moments) == 3 * len(model_keys)  # step, exp_avg, exp_avg_sq of each factor
    assert all(is_factor(key.removeprefix("optim.state.").rsplit(".", 1)[0]) for key in moments)
    lines = (tiny_lora_run / "ckpt" / "metrics.jsonl").read_text().splitlines()
    records = [record for record in map(json.loads, lines) if record["kind"] == "train"]
    assert resumed.start_step == 1 and [r["step"] for r in resumed.records] == [2]
    assert (resumed.records[0]["loss"], resumed.records[0]["grad_norm"]) == (
        records[1]["loss"],
        records[1]["grad_norm"],
    )
