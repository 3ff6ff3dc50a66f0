"""The vision towers' speed-ups under ``mindspeed`` equal transformers' own computation.

Windows in one varlen call:
Under ``mindspeed`` the model's vision sub-config is named ``mindspeed_flash_varlen``, so
Qwen2.5-VL's window attention (and Qwen3-VL's per-image attention) hands all its boundaries to
one call of the core's varlen kernel instead of one call per window. The reference is the same
weights loaded with ``sdpa``: transformers splits the row and attends window by window. Images
of several sizes give windows of unequal lengths (edge windows), several per image.

Patch embeddings as a matmul: convolutions whose stride is their kernel (Qwen-VL's ``Conv3d``
over single patches, InternVL's ``Conv2d`` over tiles) give the convolution's outputs and
gradients, keep their parameters and state dict, and leave other convolutions alone.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mindspeed_mm.models import attention as attention_module
from mindspeed_mm.models import family_of, load_model
from mindspeed_mm.models.attention import VARLEN_NAME
from mindspeed_mm.models.patch_linear import LinearPatchConv3d, use_linear_patches


def _images(config, sides):
    """``pixel_values`` and ``grid_thw`` of images of ``sides`` patches (height, width), random pixels."""
    vision = config.vision_config
    channels = getattr(vision, "in_chans", None) or vision.in_channels
    width = channels * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor([[1, h, w] for h, w in sides])
    generator = torch.Generator().manual_seed(0)
    return torch.randn(int(grid.prod(-1).sum()), width, generator=generator), grid


@pytest.mark.parametrize("fixture", ["tiny_vlm", "tiny_qwen3_vl"])
def test_vision_tower_in_one_varlen_call_equals_window_by_window(fixture, request, tmp_path) -> None:
    model_dir = request.getfixturevalue(fixture)[0]
    family = family_of(model_dir)
    ours, reference = load_model(model_dir, family), load_model(model_dir, family, "sdpa")
    assert ours.config.vision_config._attn_implementation == VARLEN_NAME
    assert ours.config.text_config._attn_implementation == "mindspeed"  # the language model keeps its own
    assert type(ours.model.visual.patch_embed.proj) is LinearPatchConv3d
    assert type(reference.model.visual.patch_embed.proj) is torch.nn.Conv3d  # sdpa: transformers' model as built
    assert ours.state_dict().keys() == reference.state_dict().keys()
    pixels, grid = _images(ours.config, [(8, 12), (4, 4), (6, 10), (2, 2)])  # windows of 4x4 patches and edges

    calls = []
    kernel = attention_module._kernel

    def counted(*args):
        attend = kernel(*args)

        def wrapper(*a, **k):
            calls.append(k.get("cu_seqlens"))
            return attend(*a, **k)

        return wrapper

    outputs, grads = [], []
    for model in (ours, reference):
        attention_module._kernel = counted
        try:
            out = model.model.visual(pixels, grid_thw=grid).pooler_output
        finally:
            attention_module._kernel = kernel
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad for n, p in model.model.visual.named_parameters()})
    blocks = len(ours.model.visual.blocks)
    assert len(calls) == blocks and all(c is not None for c in calls)  # one call per block, all from ours
    if family.architecture == "Qwen2_5_VLForConditionalGeneration":
        assert max(len(c) - 1 for c in calls) > len(grid)  # windows, more of them than images
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        # The summation order differs (one varlen call against window by window): the tolerance is relative to
        # each gradient's own scale, so sums of many terms that nearly cancel are not held to 1e-5 absolute.
        scale = 0.0 if grads[1][name] is None else float(grads[1][name].abs().max())
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-4 * scale + 1e-7, msg=name)

    # The name is the loaded model's, never the checkpoint's: an export keeps transformers' defaults.
    ours.save_pretrained(tmp_path)
    assert VARLEN_NAME not in (tmp_path / "config.json").read_text()
    assert "vision_config" in json.loads((tmp_path / "config.json").read_text())


def test_varlen_attention_refuses_boundaries_with_a_mask() -> None:
    q = torch.randn(1, 2, 6, 4)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="mask or dropout"):
        attention_module.varlen_attention(
            torch.nn.Module(), q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool), cu_seq_lens_q=cu, cu_seq_lens_k=cu
        )


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4)), (5, 3, 2, 4, 4)),  # Qwen-VL: one patch per row
        (torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=False), (2, 3, 4, 8, 12)),  # several patches
        (torch.nn.Conv2d(3, 8, 4, stride=4), (2, 3, 12, 16)),  # InternVL: a tile
        (torch.nn.Conv2d(3, 8, 4, stride=4), (2, 3, 13, 16)),  # not tiled: the convolution itself
    ],
)
def test_linear_patches_equal_the_convolution(conv, shape) -> None:
    torch.manual_seed(0)
    plain = copy.deepcopy(conv)
    model = torch.nn.Sequential(torch.nn.Identity(), conv, torch.nn.Conv2d(3, 3, 3, stride=1))  # the last is no patcher
    assert use_linear_patches(model) == ["1"]
    assert type(model[2]) is torch.nn.Conv2d and conv.weight is model[1].weight
    x = torch.randn(shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = conv(x), plain(x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    weights = torch.randn(ref.shape)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(conv.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_internvl_tile_embedding_is_a_matmul(tiny_internvl) -> None:
    model = load_model(tiny_internvl[0], family_of(tiny_internvl[0]))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert names and all(type(model.get_submodule(n)).__name__ == "LinearPatchConv2d" for n in names), names
