"""The actor's log-prob pass and update run without the device redirect, as the LLM trainer's step does.

One spawned rank builds the tiny Llama actor twice from the same checkpoint: first with its
calls left under the device redirect that ``adapt()`` enters for setup (the actor before the
fast path), then as it runs now (``compute_logprobs`` / ``update`` / ``forward_logits`` inside
``mindspeed.megatron.fast_path()``). Every call of the redirect's ``__torch_function__`` is
counted per actor call: under the redirect each makes hundreds of Python hops, on the fast path
none (and no function mode is on the stack while megatron's schedule runs). Log-probs, losses,
gradient norms and the logits after two optimizer steps are bit-identical, so the CUDA call
sites are handled by the patches (``mindspeed.megatron.device_sites``), not skipped.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
ADV = [1.0, -1.0, 0.5]
CALLS = ("logprobs", "update", "update2", "logits")


def _drive(root: str, calls: list[int]) -> dict[str, Any]:
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"))
    stack: list[int] = []
    schedule = actor._schedule

    def watched(*args: Any, **kwargs: Any) -> Any:
        stack.append(torch._C._len_torch_function_stack())
        return schedule(*args, **kwargs)

    actor._schedule = watched
    advantages = torch.tensor(ADV)
    steps = {
        "logprobs": lambda: actor.compute_logprobs(PAIRS),
        "update": lambda: actor.update(PAIRS, None, advantages),
        "update2": lambda: actor.update(PAIRS, None, advantages),  # after an optimizer step
        "logits": lambda: actor.forward_logits([*PAIRS[0][0], *PAIRS[0][1]]),
    }
    out: dict[str, Any] = {"hops": {}, "stack": stack}
    try:
        for name in CALLS:
            before, cpu = calls[0], time.process_time()
            out[name] = steps[name]()
            out["hops"][name] = calls[0] - before
            out[f"{name}_cpu"] = time.process_time() - cpu
    finally:
        actor.close()
    out["logprobs"] = [row.numpy() for row in out["logprobs"]]
    out["logits"] = out["logits"].numpy()
    return out


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed.device.cuda_shim import DeviceRedirectMode
    from mindspeed_rl.models import actor as actor_module

    calls = [0]
    original = DeviceRedirectMode.__torch_function__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    DeviceRedirectMode.__torch_function__ = counted
    fast_path = actor_module.fast_path
    results = {}
    try:
        for name, scope in (("redirect", contextlib.nullcontext), ("fast", fast_path)):
            actor_module.fast_path = scope
            results[name] = _drive(root, calls)
    finally:
        DeviceRedirectMode.__torch_function__ = original
        actor_module.fast_path = fast_path
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("actor_fast_path")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 1, str(root), timeout=300)[0]


def test_actor_calls_make_no_torch_function_hop(runs: dict[str, Any]) -> None:
    fast, slow = runs["fast"], runs["redirect"]
    assert fast["hops"] == dict.fromkeys(CALLS, 0), fast["hops"]
    assert set(fast["stack"]) == {0}, "a torch function mode is on the stack while megatron's schedule runs"
    # Before: every torch call of the actor went through the redirect.
    assert min(slow["hops"].values()) > 100, slow["hops"]
    assert set(slow["stack"]) == {1}


def test_fast_path_gives_the_same_numbers(runs: dict[str, Any]) -> None:
    fast, slow = runs["fast"], runs["redirect"]
    for a, b in zip(fast["logprobs"], slow["logprobs"]):
        assert (a == b).all()
    for key in ("update", "update2"):
        assert fast[key]["loss"] == slow[key]["loss"], key
        assert fast[key]["grad_norm"] == slow[key]["grad_norm"], key
    # On-policy the loss is the advantages' (ratio 1); the gradient shows the policy moved.
    assert fast["update2"]["grad_norm"] != fast["update"]["grad_norm"], (
        "the first optimizer step did not move the policy"
    )
    assert (fast["logits"] == slow["logits"]).all()
