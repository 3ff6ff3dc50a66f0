"""Qwen2.5-Omni's thinker under Ulysses SP2 and DP2 equals one rank, in one spawned group of two gloo ranks.

Four samples (audio, video + audio, image + audio, text only), one sample a microbatch, two steps of two
microbatches (SP1: one rank accumulating two; SP2: both ranks share each microbatch, each holds half
of the language model's sequence; DP2: one microbatch per rank, so at step 2 one rank has an image and
a clip and the other text only, and runs the towers' dummy inputs, audio included). Losses,
gradient norms and token counts agree; the Ulysses all-to-all ran in every language-model attention
call of SP2, and the video's frames were shared out over the SP group (``VisionBalance``).
"""

from __future__ import annotations

import pytest

from mindspeed.testing.distributed import run_distributed
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.testing import write_tiny_audio_dataset, write_tiny_model
from mindspeed_mm.trainer.loop import train


def _overrides(model_dir, data, sp: int, dp: int, tmp) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.files=[{data}]",
        "data.shuffle=false",
        "train.steps=2",
        "train.micro_batch_size=1",
        f"train.gradient_accumulation_steps={2 // dp}",
        f"parallel.ulysses_parallel_size={sp}",
        "train.precision=fp32",
        "train.lr=1e-3",
        "train.lr_warmup_steps=1",
        "train.clip_grad=1.0",
        "logging.progress=false",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
        f"logging.dir={tmp}",
    ]


def _runs(rank: int, world: int, sp2: list[str], dp2: list[str]) -> dict:
    import mindspeed_mm.models.attention as attention
    from mindspeed_mm.trainer.vision_balance import VisionBalance
    from mindspeed_mm.trainer.vision_sync import VisionSync

    calls = {"ulysses": 0, "dummy_audio": 0, "shared": 0}
    original, audio_hook, split = attention.ulysses_attention, VisionSync._audio_hook, VisionBalance._split

    def shared(self, module, args, kwargs):
        out = split(self, module, args, kwargs)
        calls["shared"] += self.current is not None
        return out

    def counted_audio(self, *args, **kwargs):
        calls["dummy_audio"] += self.needed_audio
        return audio_hook(self, *args, **kwargs)

    def counted(*args, **kwargs):
        calls["ulysses"] += 1
        return original(*args, **kwargs)

    attention.ulysses_attention, VisionSync._audio_hook, VisionBalance._split = counted, counted_audio, shared
    try:
        sp = train(load_mm_config(None, sp2)).records
        sp_calls = calls["ulysses"]
        dp = train(load_mm_config(None, dp2)).records
    finally:
        attention.ulysses_attention, VisionSync._audio_hook, VisionBalance._split = original, audio_hook, split
    return {"sp": sp, "dp": dp, "calls": sp_calls, "dummy_audio": calls["dummy_audio"], "shared": calls["shared"]}


def _single(config):
    return train(config)


def test_omni_sp2_and_dp2_equal_one_rank(tmp_path) -> None:
    from mindspeed.launch import launch

    model_dir = write_tiny_model(tmp_path / "omni", "Qwen2_5OmniThinkerForConditionalGeneration")
    data = write_tiny_audio_dataset(tmp_path / "data", num_samples=4, video_every=2)
    one = launch(_single, (load_mm_config(None, _overrides(model_dir, data, 1, 1, tmp_path / "one")),)).records
    out = run_distributed(
        _runs,
        2,
        _overrides(model_dir, data, 2, 1, tmp_path / "sp2"),
        _overrides(model_dir, data, 1, 2, tmp_path / "dp2"),
        timeout=300,
    )
    # the dummy clip: SP2's text-only microbatch on both ranks, and DP2's text-only rank at step 2
    assert [o["dummy_audio"] for o in out] == [1, 2]
    assert [o["shared"] for o in out] == [1, 1]  # SP2: the video's two temporal patches, one per rank
    out = out[0]
    assert out["calls"] == 2 * 2 * 2  # 2 layers x 2 microbatches x 2 steps
    for name in ("sp", "dp"):
        assert [r["step"] for r in out[name]] == [1, 2]
        for reference, record in zip(one, out[name], strict=True):
            assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5), (name, record["step"])
            assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), (name, record["step"])
            assert record["tokens"] == reference["tokens"], name
    print("Omni SP1 / SP2 / DP2 losses:", [[round(r["loss"], 6) for r in rs] for rs in (one, out["sp"], out["dp"])])
