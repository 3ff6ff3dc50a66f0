"""Each family's ``encoders`` (input kind -> module prefixes) names exactly the parameters its encoder call reaches.

The FSDP2 trainer drops the gradients under those prefixes in a step where no rank had that
input (:meth:`mindspeed_mm.trainer.vlm_task.VLMTask.finish_gradients`), so a prefix too wide would
drop a real gradient and one too narrow would let AdamW move a parameter one rank leaves alone.
Here the family's dummy call of each kind (the one the trainer's ranks run) is traced on the
unsharded tiny model: the parameters of the modules that ran, and those that got a gradient
from a backward through its output, both equal the parameters under the prefixes (but for
Qwen2.5-Omni's ``audio_tower.audio_bos_eos_token``, which transformers' thinker never uses: it has
no gradient on one rank either).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_mm.models import family_of, load_model
from mindspeed_mm.testing.fixtures import write_tiny_model

#: parameters under a prefix that no forward of the model uses (no gradient on one rank either)
NEVER_USED = {"audio_tower.audio_bos_eos_token.weight"}
ARCHITECTURES = (
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "InternVLForConditionalGeneration",
    "Qwen2_5OmniThinkerForConditionalGeneration",
)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_encoder_prefixes_are_what_the_dummy_calls_reach(architecture, tmp_path) -> None:
    model_dir = write_tiny_model(tmp_path / "model", architecture)
    family = family_of(model_dir)
    model = load_model(model_dir, family)
    owner = model.model if hasattr(model.model, "get_image_features") else model
    calls = {"image": (owner.get_image_features, family.dummy_vision_inputs)}
    if family.dummy_video_inputs is not None:
        calls["video"] = (owner.get_video_features, family.dummy_video_inputs)
    if family.dummy_audio_inputs is not None:
        calls["audio"] = (model.get_audio_features, family.dummy_audio_inputs)
    assert set(family.encoders) == set(calls) or set(family.encoders) == {"image"} == set(calls) - {"video"}
    for kind, prefixes in family.encoders.items():
        call, inputs = calls[kind]
        ran: set[int] = set()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: ran.add(id(m)))
        try:
            out = call(**inputs(model.config))
        finally:
            handle.remove()
        reached = {
            f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            if id(module) in ran
            for name, _ in module.named_parameters(recurse=False)
        }
        model.zero_grad(set_to_none=True)
        sum(t.float().sum() for t in _tensors(out) if t.requires_grad).backward()
        graded = {name for name, p in model.named_parameters() if p.grad is not None}
        declared = {
            name
            for name, _ in model.named_parameters()
            if any(name.startswith(p + ".") for p in prefixes) and name not in NEVER_USED
        }
        assert reached == declared, (kind, sorted(reached ^ declared)[:5])
        assert graded == declared, (kind, sorted(graded ^ declared)[:5])
