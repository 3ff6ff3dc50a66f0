"""The first training loss (and gradient norm) equals transformers' own, computed sample by sample.

The reference runs the Hugging Face model on each sample alone (its own multimodal positions
from ``mm_token_type_ids``, its own label shift and loss) and combines the per-sample losses as
each reduction defines. The trainer packs the same samples into one sequence per microbatch.
Two broken variants of the packed batch (text positions on the rotary axes; no sample
boundaries) are shown to miss the reference, so the equality is not an accident. The same holds
for a batch with videos (an .mp4, an image and an .mp4, a frame folder; PyAV-written), trained
with ``data.workers=2`` and a cache; for Qwen2.5-VL, videos' positions without
``second_per_grid_ts`` miss it too. InternVL's images are cut into tiles plus a thumbnail as
transformers' ``InternVLProcessor`` cuts them: its tokens and pixels equal ours, sample by sample.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.data import pack_samples, read_mllm_files
from mindspeed_mm.data.preprocess import EncodeSettings, Processing
from mindspeed_mm.data.video import VideoSettings
from mindspeed_mm.models import family_of, load_model, load_processing, load_video_processor
from mindspeed_mm.trainer.loop import train
from mindspeed_mm.trainer.loss import token_losses

SAMPLES = 4  # samples 0-3: three with images of different sizes, one text-only
VIDEO = VideoSettings(fps=4, maxlen=6, max_pixels=3136, min_pixels=256)  # the recipe's data.video_* below


def _reference(model_dir, data):
    """Per sample: (Hugging Face loss, predicted tokens, grads of loss x tokens), plus the encoded samples."""
    family = family_of(model_dir)
    tokenizer, processor = load_processing(model_dir, 28 * 28, 112 * 112)
    model = load_model(model_dir, family, "sdpa")  # transformers' own attention is the reference
    samples = read_mllm_files([str(data)])[:SAMPLES]
    videos = load_video_processor(model_dir) if any(s.videos for s in samples) else None
    processing = Processing(tokenizer, processor, family, videos)
    encoded = [processing.encode(s, EncodeSettings(cutoff_len=1024, video=VIDEO)) for s in samples]
    losses, counts, grads = [], [], []
    for sample in encoded:
        inputs = {"input_ids": sample.input_ids[None], "labels": sample.labels[None], "use_cache": False}
        if family.architecture != "InternVLForConditionalGeneration":  # M-RoPE families need the token types
            inputs["mm_token_type_ids"] = sample.mm_token_type_ids[None]
        inputs.update(sample.vision)
        model.zero_grad()
        loss = model(**inputs).loss
        (loss * sample.num_label_tokens).backward()
        losses.append(float(loss.detach()))
        counts.append(sample.num_label_tokens)
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
    return model, family, encoded, losses, counts, grads


@pytest.fixture(scope="module")
def reference(tiny_vlm):
    return _reference(*tiny_vlm)


def _norm(grads):
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def _first_step(model_dir, data, tmp_path, data_overrides=(), **train):
    overrides = [
        *data_overrides,
        f"model.path={model_dir}",
        f"data.files=[{data}]",
        "data.shuffle=false",
        "train.steps=1",
        "train.precision=fp32",
        "train.clip_grad=0",
        "logging.progress=false",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
        f"data.video_fps={VIDEO.fps}",
        f"data.video_maxlen={VIDEO.maxlen}",
        f"data.video_max_pixels={VIDEO.max_pixels}",
        f"data.video_min_pixels={VIDEO.min_pixels}",
        f"logging.dir={tmp_path}",
    ]
    overrides += [f"train.{k}={v}" for k, v in train.items()]
    return launch(train_rank, (load_mm_config(None, overrides),)).records[0]


def train_rank(config):
    return train(config)


def _check(model_dir, data, reference, tmp_path, all_reductions: bool, data_overrides=()) -> None:
    model, family, encoded, losses, counts, grads = reference
    n = sum(counts)
    per_token = sum(loss * c for loss, c in zip(losses, counts)) / n
    expected = {
        # one microbatch of 4 packed samples: the token mean (= per_token here)
        ("default", 4, 1): (per_token, [sum(g[i] for g in grads) / n for i in range(len(grads[0]))])
    }
    if all_reductions:  # two microbatches of 2 samples each
        expected[("per_token", 2, 2)] = (per_token, None)
        expected[("per_sample", 2, 2)] = (sum(losses) / SAMPLES, None)
    for (loss_type, micro, accumulation), (loss, grad) in expected.items():
        record = _first_step(
            model_dir,
            data,
            tmp_path,
            data_overrides,
            loss_type=loss_type,
            micro_batch_size=micro,
            gradient_accumulation_steps=accumulation,
        )
        assert record["loss"] == pytest.approx(loss, rel=1e-6), (loss_type, micro, accumulation)
        if grad is not None:
            assert record["grad_norm"] == pytest.approx(_norm(grad), rel=1e-4)

    # The same comparison fails without the multimodal positions or without the sample boundaries.
    batch = pack_samples(encoded, model, family)
    with torch.no_grad():

        def packed_loss(position_ids):
            inputs = {**batch.model_inputs(torch.device("cpu")), "position_ids": position_ids}
            losses = token_losses(model(**inputs).logits[0], batch.targets)
            return float(losses.sum() / batch.num_label_tokens)

        assert packed_loss(batch.position_ids) == pytest.approx(per_token, rel=1e-6)
        positions = batch.position_ids
        if positions.shape[0] == 4:  # M-RoPE
            one_d = abs(packed_loss(positions[:1].expand(4, -1, -1)) - per_token)
            unbounded = abs(packed_loss(positions[1:]) - per_token)  # attention across samples
            assert one_d > 1e-4
        else:
            one_d = float("nan")
            unbounded = abs(packed_loss(torch.arange(positions.shape[-1])[None]) - per_token)
        no_seconds = float("nan")
        if "second_per_grid_ts" in batch.vision:  # Qwen2.5-VL: videos' temporal positions without their spacing
            plain = [type(s)(**{**s.__dict__, "vision": {**s.vision}}) for s in encoded]
            for sample in plain:
                sample.vision.pop("second_per_grid_ts", None)
            no_seconds = abs(packed_loss(pack_samples(plain, model, family).position_ids) - per_token)
            assert no_seconds > 1e-4
        print(
            f"{family.architecture}: packed loss {per_token:.6f}; error with 1-D positions {one_d:.2e}, "
            f"without boundaries {unbounded:.2e}, without second_per_grid_ts {no_seconds:.2e}"
        )
        assert unbounded > 1e-4


def test_qwen2_5_vl_first_loss_equals_transformers_sample_by_sample(tiny_vlm, reference, tmp_path) -> None:
    _check(*tiny_vlm, reference, tmp_path, all_reductions=True)


def test_qwen3_vl_first_loss_equals_transformers_sample_by_sample(tiny_qwen3_vl, tmp_path) -> None:
    _check(*tiny_qwen3_vl, _reference(*tiny_qwen3_vl), tmp_path, all_reductions=False)


def test_internvl_first_loss_equals_transformers_sample_by_sample(tiny_internvl, tmp_path) -> None:
    """With the images tiled as transformers' InternVLProcessor tiles them (tiles and a thumbnail)."""
    from tests.mm.hf_reference import processor_inputs

    model_dir, data = tiny_internvl
    reference = _reference(model_dir, data)
    tokenizer, processor = load_processing(model_dir, 28 * 28, 112 * 112)
    processing = Processing(tokenizer, processor, family_of(model_dir), load_video_processor(model_dir))
    tiles = []
    for sample, ours in zip(read_mllm_files([str(data)])[:SAMPLES], reference[2], strict=True):
        theirs = processor_inputs(processing, sample, VIDEO)
        assert torch.equal(theirs["input_ids"][0], ours.input_ids), sample.source
        if sample.images:
            assert torch.equal(theirs["pixel_values"], ours.vision["pixel_values"]), sample.source
            tiles.append(ours.vision["pixel_values"].shape[0])
    print(f"InternVL tiles per image: {tiles}")
    assert max(tiles) >= 3  # some image cut into 2+ tiles, plus its thumbnail
    _check(model_dir, data, reference, tmp_path, all_reductions=False)


def test_bf16_and_frozen_parts(tiny_vlm, reference, tmp_path) -> None:
    """bf16 compute parameters (fp32 master and reduction) stay near the fp32 loss; frozen parts do not move."""
    from safetensors.torch import load_file

    model_dir, data = tiny_vlm
    _, _, _, losses, counts, _ = reference
    per_token = sum(loss * c for loss, c in zip(losses, counts)) / sum(counts)
    record = _first_step(model_dir, data, tmp_path, micro_batch_size=4, precision="bf16", lr=0.01)
    assert record["loss"] == pytest.approx(per_token, rel=2e-2) and record["loss"] != pytest.approx(per_token, rel=1e-6)
    config = load_mm_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.files=[{data}]",
            "data.shuffle=false",
            "train.steps=1",
            "train.micro_batch_size=4",
            "train.lr=0.01",
            "train.precision=bf16",
            "model.freeze=[vision_tower, projector]",
            f"checkpoint.save_hf={tmp_path / 'hf'}",
            "logging.progress=false",
            "data.image_max_pixels=12544",
        ],
    )
    launch(train_rank, (config,))
    before, after = load_file(model_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(before) == set(after)
    for name in before:  # names on disk are the hub's (``visual.*``), which save_pretrained writes
        same = torch.equal(before[name], after[name])
        assert same == name.startswith("visual."), name


@pytest.mark.parametrize("family", ["tiny_vlm", "tiny_qwen3_vl", "tiny_internvl"])
def test_video_first_loss_equals_transformers_sample_by_sample(family, tiny_video_data, tmp_path, request) -> None:
    """Videos (and an image beside one), encoded by 2 worker processes into a cache, then trained."""
    model_dir = request.getfixturevalue(family)[0]
    cache = ["data.workers=2", f"data.cache_dir={tmp_path / 'cache'}"]
    _check(model_dir, tiny_video_data, _reference(model_dir, tiny_video_data), tmp_path, False, cache)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the run wrote its entry


def test_multimodal_positions_need_mm_token_type_ids(tiny_vlm, tiny_qwen3_vl) -> None:
    """Why every path passes ``mm_token_type_ids`` (the packed positions come from ``get_rope_index`` with them):
    without them transformers' Qwen3-VL forward raises on an image sample, and Qwen2.5-VL's silently falls back
    to 1-D positions and gives another loss."""
    sample = max(read_mllm_files([str(tiny_vlm[1])])[:SAMPLES], key=lambda s: len(s.images))
    for model_dir in (tiny_vlm[0], tiny_qwen3_vl[0]):
        family = family_of(model_dir)
        encoded = Processing(*load_processing(model_dir, 28 * 28, 112 * 112), family).encode(
            sample, EncodeSettings(cutoff_len=1024)
        )
        assert "image_grid_thw" in encoded.vision and int(encoded.mm_token_type_ids.sum()) > 1
        model = load_model(model_dir, family, "sdpa")
        inputs = {"input_ids": encoded.input_ids[None], "labels": encoded.labels[None], "use_cache": False}
        inputs.update(encoded.vision)
        with torch.no_grad():
            with_types = float(model(**inputs, mm_token_type_ids=encoded.mm_token_type_ids[None]).loss)
            if family.architecture == "Qwen3VLForConditionalGeneration":
                with pytest.raises(ValueError, match="`mm_token_type_ids` is missing"):
                    model(**inputs)
            else:  # Qwen2.5-VL: 1-D positions, no error
                assert abs(float(model(**inputs).loss) - with_types) > 1e-4


def _valid_rank(config):
    return train(config).evals


def test_validation_loss_equals_transformers_under_each_reduction(tiny_vlm, reference, tmp_path) -> None:
    """At lr 0 the validation loss after step 1 is the untrained model's: transformers' per-sample losses of the
    first ``eval.iters`` x 4 samples (microbatches of 2) combined as each reduction defines."""
    model_dir, data = tiny_vlm
    _, _, _, losses, counts, _ = reference
    means = [sum(x * c for x, c in zip(losses[i : i + 2], counts[i : i + 2])) / sum(counts[i : i + 2]) for i in (0, 2)]
    expected = {
        "default": sum(means) / 2,
        "per_token": sum(x * c for x, c in zip(losses, counts)) / sum(counts),
        "per_sample": sum(losses) / SAMPLES,
    }
    for loss_type, loss in expected.items():
        overrides = [
            f"model.path={model_dir}",
            f"data.files=[{data}]",
            f"data.valid_files=[{data}]",  # 8 samples; eval.iters=1: the first global batch of 4
            "eval.iters=1",
            "train.steps=1",
            "train.lr=0",
            "train.micro_batch_size=2",
            "train.gradient_accumulation_steps=2",
            f"train.loss_type={loss_type}",
            "train.precision=fp32",
            "logging.progress=false",
            "data.image_min_pixels=784",
            "data.image_max_pixels=12544",
        ]
        (record,) = launch(_valid_rank, (load_mm_config(None, overrides),))
        assert record["step"] == 1 and record["tokens"] == sum(counts), loss_type
        assert record["loss"] == pytest.approx(loss, rel=1e-6), loss_type
    assert len({round(v, 6) for v in expected.values()}) == 3, expected  # the reductions differ here
