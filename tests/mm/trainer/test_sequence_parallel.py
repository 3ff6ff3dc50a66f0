"""Ulysses sequence parallelism equals data parallelism, in one spawned group of two gloo ranks.

SP2 (both ranks share each packed microbatch, each holds half of the language model's sequence,
two accumulated microbatches) and DP2 (one microbatch per rank) see the same samples per step,
so their losses, gradient norms and gradients must agree:

- Qwen2.5-VL (M-RoPE positions, split with the tokens), ``default`` loss, 3 steps;
- InternVL (1-D positions), ``per_token`` loss, 2 steps;
- Qwen3-VL (DeepStack visual embeddings, split with the tokens), ``per_sample`` loss, 2 steps;
- Qwen2.5-VL on videos (an .mp4, an image and an .mp4, text only, a frame folder; 2 samples a
  microbatch), 2 steps, and Qwen3-VL on them, 1 step: the video frames are shared out over the
  group, one video cut between the ranks;
- the gradients of one step (embeddings, a vision block, an attention projection, the head)
  gathered from the FSDP2 shards, for the image and the video runs;
- the validation loss at the end (5 held-out samples, microbatches of 3 and 2: both on the SP
  group, one per rank in DP2) under each of the three reductions.

The Ulysses all-to-all must have run in every language-model attention call of the SP runs, and
the vision encoders' work must have been shared (microbatches with two images: one per rank;
videos: frames on both ranks, a video cut in two).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mindspeed.testing.distributed import run_distributed
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.trainer.loop import train

#: A few parameters whose gradients are compared (by name suffix).
GRADS = ("embed_tokens.weight", "blocks.0.attn.qkv.weight", "layers.1.self_attn.q_proj.weight", "lm_head.weight")


#: The video run's decoding (``data.video_*``) and its microbatch (2 of the 4 samples).
VIDEO = ["data.video_fps=4", "data.video_maxlen=6", "data.video_max_pixels=3136", "train.micro_batch_size=2"]


def _overrides(model_dir: Path, data: Path, sp: int, steps: int, loss_type: str, extra: list[str] = ()) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.files=[{data}]",
        f"train.steps={steps}",
        "train.micro_batch_size=3",
        f"train.gradient_accumulation_steps={sp}",
        f"parallel.ulysses_parallel_size={sp}",
        f"train.loss_type={loss_type}",
        "train.precision=fp32",
        "train.lr=1e-3",
        "train.lr_warmup_steps=1",
        "train.clip_grad=1.0",
        "logging.progress=false",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
        *extra,
    ]


def _step_grads(config) -> dict[str, np.ndarray]:
    """Gradients of step 1, gathered from the shards (numpy: tensors do not outlive the spawned rank)."""
    from mindspeed_mm.trainer.task import TASKS

    world, rank = dist.get_world_size(), dist.get_rank()
    config.check(world)
    task = TASKS.get("vlm")(config, world)
    micro = task.microbatches(1, rank)
    totals = task.counts(micro)
    dist.all_reduce(totals)
    for batch in micro:
        task.loss(batch, totals)[0].backward()
    return {
        name: param.grad.full_tensor().numpy()
        for name, param in task.model.named_parameters()
        if name.endswith(GRADS) and param.grad is not None
    }


def _both(rank: int, world: int, runs: list[tuple[list[str], list[str]]], grads: tuple[int, ...]) -> dict:
    import mindspeed_mm.models.attention as attention
    from mindspeed_mm.trainer.vision_balance import VisionBalance

    calls = {"ulysses": 0, "shared": 0, "frames": 0, "cut": 0}
    original, split = attention.ulysses_attention, VisionBalance._split

    def counted(*args, **kwargs):
        calls["ulysses"] += 1
        return original(*args, **kwargs)

    def shared(self, module, args, kwargs):
        out = split(self, module, args, kwargs)
        share = self.current
        if share is not None:
            calls["shared"] += 1
            if share.grid is not None and int(share.full_grid[:, 0].max()) > 1:  # a video's frames shared out
                calls["frames"] += 1
                # a video cut between the ranks: the share's rows start or end inside a grid row
                bounds = set(torch.cat([torch.zeros(1), share.full_grid.prod(1).cumsum(0)]).long().tolist())
                calls["cut"] += not set(share.rows) <= bounds
        return out

    attention.ulysses_attention, VisionBalance._split = counted, shared
    out: dict = {"sp": [], "dp": [], "calls": [], "grads": []}
    try:
        for sp, dp in runs:
            before = calls["ulysses"]
            result = train(load_mm_config(None, sp))
            out["sp"].append((result.records, result.evals))
            out["calls"].append(calls["ulysses"] - before)
            result = train(load_mm_config(None, dp))
            out["dp"].append((result.records, result.evals))
            assert calls["ulysses"] == before + out["calls"][-1]  # DP2 never calls it
        for index in grads:
            sp, dp = runs[index]
            out["grads"].append((_step_grads(load_mm_config(None, sp)), _step_grads(load_mm_config(None, dp))))
    finally:
        attention.ulysses_attention, VisionBalance._split = original, split
    out.update({key: calls[key] for key in ("shared", "frames", "cut")})
    return out


def test_sp2_equals_dp2(tiny_vlm, tiny_internvl, tiny_qwen3_vl, tiny_video_data, tiny_valid) -> None:
    video = (tiny_vlm[0], tiny_video_data)
    valid = [f"data.valid_files=[{tiny_valid}]"]  # scored at the end
    cases = [
        (tiny_vlm, 3, "default", valid),
        (tiny_internvl, 2, "per_token", valid),
        (tiny_qwen3_vl, 2, "per_sample", valid),
        (video, 2, "default", VIDEO),
        ((tiny_qwen3_vl[0], tiny_video_data), 1, "default", VIDEO),  # DeepStack features of shared frames
    ]
    runs = [(_overrides(*t, 2, steps, loss, x), _overrides(*t, 1, steps, loss, x)) for t, steps, loss, x in cases]
    out = run_distributed(_both, 2, runs, (0, 3), timeout=300)
    for rank_out, (_, steps, _, extra) in zip(out[0]["calls"], cases):  # 2 layers x 2 microbatches a step
        assert rank_out == 2 * 2 * steps + (2 * 2 if extra == valid else 0)  # + 2 validation microbatches
    for key in ("shared", "frames", "cut"):  # the same microbatches on both ranks
        assert out[0][key] > 0 and out[0][key] == out[1][key], key
    result = out[0]
    for (_, steps, loss, extra), (sp, sp_evals), (dp, dp_evals) in zip(cases, result["sp"], result["dp"], strict=True):
        assert [r["step"] for r in sp] == [r["step"] for r in dp] == list(range(1, steps + 1))
        for one, two in zip(dp, sp, strict=True):
            assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), (loss, one["step"])
            assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), (loss, one["step"])
            assert two["tokens"] == one["tokens"]
        assert [r["step"] for r in sp_evals] == [r["step"] for r in dp_evals] == ([steps] if extra == valid else [])
        for one, two in zip(dp_evals, sp_evals):
            assert two["loss"] == pytest.approx(one["loss"], rel=1e-5) and two["tokens"] == one["tokens"], loss
    for sp_grads, dp_grads in result["grads"]:
        assert len(sp_grads) == len(GRADS) and set(sp_grads) == set(dp_grads)
        for name, grad in sp_grads.items():
            torch.testing.assert_close(
                torch.from_numpy(grad), torch.from_numpy(dp_grads[name]), rtol=1e-4, atol=1e-6, msg=name
            )
            assert np.abs(grad).sum() > 0, name


def test_vision_shares() -> None:
    from mindspeed_mm.trainer.vision_balance import shares

    assert shares([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert shares([16, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert shares([1, 1, 16], 2) == [(0, 2), (2, 3)]
    assert shares([5, 5, 5], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="2 items cannot be shared by 3 ranks"):
        shares([1, 1], 3)


def test_video_frames_are_shared_out() -> None:
    from mindspeed_mm.trainer.vision_balance import share_call

    # an image (4 x 4 patches) and a video of 3 temporal patches of 4 x 4: 4 units of 16 rows
    grid = torch.tensor([[1, 4, 4], [3, 4, 4]])
    pixels = torch.zeros(64, 8)
    first, second = (share_call(pixels, grid, rank, 2) for rank in (0, 1))
    assert first.rows == (0, 32) and first.grid.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert second.rows == (32, 64) and second.grid.tolist() == [[2, 4, 4]]
    one = share_call(torch.zeros(48, 8), torch.tensor([[3, 4, 4]]), 2, 3)  # one video over 3 ranks
    assert one.rows == (32, 48) and one.grid.tolist() == [[1, 4, 4]]
    assert share_call(torch.zeros(16, 8), torch.tensor([[1, 4, 4]]), 0, 2) is None  # one image: whole
    tiles = share_call(torch.zeros(3, 3, 56, 56), None, 1, 2)  # InternVL: rows (tiles, frames)
    assert tiles.rows == (2, 3) and tiles.grid is None
