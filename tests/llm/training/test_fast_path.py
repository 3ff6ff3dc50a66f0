"""The training step runs without the device redirect: no Python torch-function hop per torch call.

One spawned rank trains the same tiny GPT for 4 steps twice: as the trainer runs it (the step
inside ``mindspeed.megatron.fast_path()``) and with the step left under the device redirect
that ``adapt()`` enters for setup (the trainer before the fast path). Every call of the
redirect's ``__torch_function__`` is counted; a loss hook reads the count at the first loss of
each step, so a step's count covers everything the loop does (data, forward, backward,
optimizer, logging). The fast path makes no hop at all (and no function mode is on the stack
while the step runs), where the redirect made thousands; losses and gradient norms are
bit-identical, so the CUDA call sites the step still has are handled by the patches
(``mindspeed.megatron.device_sites``), not skipped.

The same two runs show that the trainer builds through the one build sequence
(``training.build.build_engine``, which the RL actor calls too: tests/rl/models/test_actor_offload.py)
and that ``pretrain`` reads the model shape once (``Trainer.build`` takes it as a value).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed


def _train(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    from mindspeed.device.cuda_shim import DeviceRedirectMode
    from mindspeed_llm.testing.build_probe import record_builds
    from mindspeed_llm.training import trainer as trainer_module
    from mindspeed_llm.training.config import load_pretrain_config

    builds = record_builds()  # who reaches the model builder (passed through)
    read_shape, shape_reads = trainer_module.model_shape, [0]

    def counted_shape(*args: Any, **kwargs: Any) -> Any:
        shape_reads[0] += 1
        return read_shape(*args, **kwargs)

    trainer_module.model_shape = counted_shape
    calls = [0]
    original = DeviceRedirectMode.__torch_function__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    DeviceRedirectMode.__torch_function__ = counted
    overrides = [
        "data.mock=true",
        "data.seq_length=32",
        "model.vocab_size=128",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=128",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.steps=4",
        "train.clip_grad=1e-3",  # clipping active: the foreach scale runs
        "logging.progress=false",
    ]
    results = {}
    fast_path = trainer_module.fast_path
    try:
        for name, scope in (("fast", fast_path), ("redirect", contextlib.nullcontext)):
            at_step: dict[int, int] = {}
            stack: list[int] = []

            def hook(step: int, losses: torch.Tensor, at_step: dict = at_step, stack: list = stack) -> torch.Tensor:
                at_step.setdefault(step, calls[0])
                stack.append(torch._C._len_torch_function_stack())
                return losses

            trainer_module.fast_path = scope
            builds.clear()
            shape_reads[0] = 0
            result = trainer_module.pretrain(
                load_pretrain_config(None, overrides), trainer_module.TrainerHooks(loss_transform=hook)
            )
            steps = sorted(at_step)
            results[name] = {
                "per_step": [at_step[b] - at_step[a] for a, b in zip(steps, steps[1:])],
                "stack": stack,
                "losses": [r["loss"] for r in result.records],
                "grad_norms": [r["grad_norm"] for r in result.records],
                "builds": list(builds),
                "model_shape_reads": shape_reads[0],
            }
    finally:
        DeviceRedirectMode.__torch_function__ = original
        trainer_module.fast_path = fast_path
        trainer_module.model_shape = read_shape
    return results


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    (result,) = run_distributed(_train, 1, timeout=600)
    return result


def test_step_makes_no_torch_function_hop(runs: dict[str, Any]) -> None:
    fast, slow = runs["fast"], runs["redirect"]
    assert fast["per_step"] == [0, 0, 0], fast["per_step"]
    assert set(fast["stack"]) == {0}, "a torch function mode is on the stack during the step"
    # Before: every torch call of the step went through the redirect (hundreds per step of this 2-layer model).
    assert min(slow["per_step"]) > 500, slow["per_step"]
    assert set(slow["stack"]) == {1}


def test_fast_path_trains_the_same_numbers(runs: dict[str, Any]) -> None:
    fast, slow = runs["fast"], runs["redirect"]
    assert fast["losses"] == slow["losses"]
    assert fast["grad_norms"] == slow["grad_norms"]
    assert all(norm > 1e-3 for norm in fast["grad_norms"]), "clipping was not active"


def test_trainer_builds_through_build_engine_and_reads_the_shape_once(runs: dict[str, Any]) -> None:
    for name, run in runs.items():
        assert [(b["callers"], b["trainable"]) for b in run["builds"]] == [(["build", "build_engine"], True)], (
            name,
            run["builds"],
        )
        # pretrain reads it for the features' facts; Trainer.build takes it as a value.
        assert run["model_shape_reads"] == 1, (name, run["model_shape_reads"])
