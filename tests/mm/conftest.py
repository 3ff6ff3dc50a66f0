"""A tiny Qwen2.5-VL directory and a small image-question data set, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model, write_tiny_video_dataset


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory, data.jsonl): 8 samples, every 4th without an image, image sizes varying."""
    root = tmp_path_factory.mktemp("tiny-vlm")
    return write_tiny_model(root / "qwen2_5_vl"), write_tiny_dataset(root / "data", num_samples=8)


@pytest.fixture(scope="session")
def tiny_valid(tmp_path_factory) -> Path:
    """valid.jsonl: 5 held-out samples of the same kind (other images; the 4th text only), for ``data.valid_files``."""
    return write_tiny_dataset(tmp_path_factory.mktemp("tiny-valid"), num_samples=5, seed=1)


@pytest.fixture(scope="session")
def tiny_video_data(tmp_path_factory) -> Path:
    """video.jsonl: an .mp4, an image and an .mp4, text only, a frame folder (PyAV-written, see the fixture)."""
    return write_tiny_video_dataset(tmp_path_factory.mktemp("tiny-video"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory, tiny_vlm) -> tuple[Path, Path]:
    """(Qwen3-VL model directory, the same data.jsonl)."""
    root = tmp_path_factory.mktemp("tiny-qwen3-vl")
    return write_tiny_model(root / "qwen3_vl", "Qwen3VLForConditionalGeneration"), tiny_vlm[1]


@pytest.fixture(scope="session")
def tiny_internvl(tmp_path_factory, tiny_vlm) -> tuple[Path, Path]:
    """(InternVL model directory, the same data.jsonl)."""
    root = tmp_path_factory.mktemp("tiny-internvl")
    return write_tiny_model(root / "internvl", "InternVLForConditionalGeneration"), tiny_vlm[1]


def _train(config):
    from mindspeed_mm.trainer.loop import train

    return train(config)


@pytest.fixture(scope="session")
def tiny_lora_run(tmp_path_factory, tiny_vlm, tiny_valid) -> Path:
    """A 2-step LoRA run on the tiny Qwen2.5-VL (r 4, alpha 8, q_proj/v_proj of the language model and the
    vision tower's qkv): ``ckpt/step_0000000{1,2}`` (DCP; metrics.jsonl with the validation loss on
    ``tiny_valid`` after each step), ``peft`` (``lora.save_peft``), ``merged`` (``checkpoint.save_hf``)."""
    from mindspeed.launch import launch
    from mindspeed_mm.config import load_mm_config

    model_dir, data = tiny_vlm
    root = tmp_path_factory.mktemp("tiny-lora-run")
    config = load_mm_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.files=[{data}]",
            f"data.valid_files=[{tiny_valid}]",
            "eval.interval=1",
            "train.steps=2",
            "train.micro_batch_size=4",
            "train.precision=fp32",
            "train.lr=0.05",
            "logging.progress=false",
            # The run's tracking wiring: MLflow (a local file store) beside metrics.jsonl and TensorBoard.
            "logging.trackers=[jsonl, tensorboard, mlflow]",
            f"logging.mlflow.tracking_uri={(root / 'mlruns').as_uri()}",
            "logging.mlflow.experiment=mm-lora",
            "data.image_max_pixels=12544",
            "lora.target_modules=[q_proj, v_proj, qkv]",
            "lora.parts=[language_model, vision_tower]",
            "lora.r=4",
            "lora.alpha=8",
            f"lora.save_peft={root / 'peft'}",
            f"checkpoint.save={root / 'ckpt'}",
            "checkpoint.interval=1",
            f"checkpoint.save_hf={root / 'merged'}",
        ],
    )
    result = launch(_train, (config,))
    assert set(result.exports) == {"save_hf", "save_peft"} and [r["step"] for r in result.evals] == [1, 2]
    return root


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models' ops are far faster without OpenMP contention on a shared 2-core host."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
