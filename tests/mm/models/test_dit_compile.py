"""``train.compile``: the compiled repeated blocks of a DiT train the numbers of the eager model.

One process, the tiny Wan (2 blocks), two ``train`` steps of 2 accumulated microbatches of 2:

- fp32, ``train.compile=default``: both steps' losses and gradient norms equal the eager run's
  (rel 1e-5), and again with the blocks recomputed (the checkpoint wraps the compiled forward);
- bf16 on one rank (FSDP2 wraps the compiled blocks): the losses within 2% of the eager bf16 run;
- the two blocks share one graph (dynamo captured one), and the parameter names are unchanged;
- the combinations not supported yet (sequence parallelism, activation swap, a VLM) are refused.
"""

from __future__ import annotations

import pytest

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.loop import train

WAN = "WanTransformer3DModel"


def _overrides(model_dir, features, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        "data.text_len=8",
        "data.shuffle=false",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.gradient_accumulation_steps=2",
        "train.precision=fp32",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        *extra,
    ]


def _runs(model_dir, features) -> dict:
    from torch._dynamo.utils import counters

    runs = {}
    for name, extra in (
        ("eager", []),
        ("compiled", ["train.compile=true"]),
        ("compiled_recompute", ["train.compile=default", "train.recompute_modules=[blocks.*]"]),
        ("bf16", ["train.precision=bf16"]),
        ("bf16_compiled", ["train.precision=bf16", "train.compile=default"]),
    ):
        before = counters["stats"]["unique_graphs"]  # the counters are process-wide: other tests compile too
        result = train(load_mm_config(None, _overrides(model_dir, features, *extra)))
        runs[name] = [(r["loss"], r["grad_norm"]) for r in result.records if r.get("kind") == "train"]
        if name == "compiled":
            runs["graphs"] = counters["stats"]["unique_graphs"] - before
    return runs


def test_compiled_blocks_train_as_eager(tmp_path) -> None:
    model_dir, features = write_tiny_dit_run(tmp_path / "wan", WAN)
    runs = launch(_runs, (model_dir, features))
    eager = runs["eager"]
    assert len(eager) == 2
    for name in ("compiled", "compiled_recompute"):
        for (loss, norm), (ref_loss, ref_norm) in zip(runs[name], eager):
            assert loss == pytest.approx(ref_loss, rel=1e-5), name
            assert norm == pytest.approx(ref_norm, rel=1e-5), name
    for (loss, _), (ref_loss, _) in zip(runs["bf16_compiled"], runs["bf16"]):
        assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert runs["graphs"] == 1  # both blocks run one graph


def test_compile_names_and_errors(tmp_path) -> None:
    import torch
    from diffusers import WanTransformer3DModel

    from mindspeed_mm.models.dit_compile import compile_blocks

    model_dir, features = write_tiny_dit_run(tmp_path / "wan", WAN)
    model = WanTransformer3DModel.from_pretrained(str(model_dir))
    names = list(model.state_dict())
    assert compile_blocks(model, False) == []
    assert compile_blocks(model, True) == ["blocks.0", "blocks.1"]
    assert list(model.state_dict()) == names
    with pytest.raises(ValueError, match="names no repeated blocks"):
        compile_blocks(torch.nn.Linear(2, 2), "default")
    with pytest.raises(ValueError, match="train.compile='fast'"):
        compile_blocks(model, "fast")
    for extra in (["parallel.ulysses_parallel_size=2"], ["train.swap_modules=[blocks.0]"]):
        config = load_mm_config(None, _overrides(model_dir, features, "train.compile=default", *extra))
        with pytest.raises(ValueError, match="compiled blocks do not take"):
            config.check(2)
