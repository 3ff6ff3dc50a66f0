"""The GRPO actor never applies a diverged update and never saves non-finite state (no Ray).

One spawned single-rank group builds the actor from a tiny Llama and runs three updates with a
NaN gradient behind a finite loss at the second (the ``train.grad_nan`` fault point): the second
is skipped (metrics say so, its gradient norm is NaN), the weights, the optimizer's state and the
schedule's position after it equal those before it bit for bit, and the third applies again
(the streak ends). A checkpoint of the actor (the worker's ``save_model_checkpoint``) is written after
the first update and read back (``load_model_checkpoint``: its step); after a NaN is planted in a weight the next save is refused with one line
naming that checkpoint, and nothing else is written. A second actor whose only update is skipped
saves and resumes from that checkpoint (its optimizer never stepped: no moments saved, the fresh
ones are loaded) and updates again. The driver stops after
``train.max_nonfinite_steps`` refused updates in a row with one line.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2])]


def _state(actor: Any) -> list[torch.Tensor]:
    from mindspeed_llm.training.checkpoint import _named_state

    return [t.detach().clone() for _, t in _named_state(actor.chunks, actor.optimizer) if torch.is_tensor(t)]


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed.checkpointing import NonFiniteState, plant_nan
    from mindspeed_llm.engine import load_model_checkpoint, save_model_checkpoint
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, loss="dapo"))
    adv = torch.tensor([1.0, -1.0])
    out: dict[str, Any] = {"metrics": [actor.update(PAIRS, None, adv)]}
    saved = save_model_checkpoint(f"{root}/ck", 1, actor)
    out["loaded_step"] = load_model_checkpoint(saved, actor, load_optimizer=True)  # the state just saved
    before, position = _state(actor), actor.scheduler.num_steps
    out["metrics"].append(actor.update(PAIRS, None, adv))
    after = _state(actor)
    out["unchanged"] = len(before) > 0 and all(torch.equal(a, b) for a, b in zip(before, after))
    out["scheduler"] = (position, actor.scheduler.num_steps)
    out["metrics"].append(actor.update(PAIRS, None, adv))
    out["skips"] = (actor.skips.skipped, actor.skips.streak)
    plant_nan(next(actor.chunks[0].parameters()))
    try:
        save_model_checkpoint(f"{root}/ck", 3, actor)
        out["refused"] = None
    except NonFiniteState as err:
        out["refused"] = str(err)
    out["left"] = sorted(p.name for p in Path(f"{root}/ck").iterdir())
    out["skipped_resume"] = _skipped_then_resumed(root)
    actor.close()
    return out


def _skipped_then_resumed(root: str) -> dict[str, Any]:
    """A second actor whose only update is skipped saves, loads that checkpoint (a resume) and updates again."""
    import os

    from mindspeed_llm.engine import load_model_checkpoint, save_model_checkpoint
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, loss="dapo"))
    armed = os.environ["MINDSPEED_FAULT"]
    os.environ["MINDSPEED_FAULT"] = "train.grad_nan@1"  # this actor's first update only
    try:
        adv = torch.tensor([1.0, -1.0])
        out: dict[str, Any] = {"skipped": actor.update(PAIRS, None, adv)["skipped"]}
        path = save_model_checkpoint(f"{root}/skipped", 1, actor)
        weights = _state(actor)
        out["step"] = load_model_checkpoint(path, actor, load_optimizer=True)
        out["same"] = all(torch.equal(a, b) for a, b in zip(weights, _state(actor)))
        out["next"] = actor.update(PAIRS, None, adv)
    finally:
        os.environ["MINDSPEED_FAULT"] = armed
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("actor-nonfinite")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    env = {"MINDSPEED_FAULT": "train.grad_nan@2"}
    return run_distributed(_group, 1, str(root), timeout=300, env=env)[0], root


def test_a_nan_gradient_update_is_skipped(run: tuple[dict[str, Any], Path]) -> None:
    out, _ = run
    skipped = [m["skipped"] for m in out["metrics"]]
    assert skipped == [0.0, 1.0, 0.0], skipped
    bad = out["metrics"][1]
    assert math.isfinite(bad["loss"]) and math.isnan(bad["grad_norm"]), bad
    assert math.isfinite(out["metrics"][2]["grad_norm"])
    assert out["unchanged"], "the skipped update changed the weights or the optimizer's state"
    assert out["scheduler"][0] == out["scheduler"][1], "the schedule advanced on the skipped update"
    assert out["skips"] == (1, 0)


def test_a_save_with_a_nan_weight_is_refused(run: tuple[dict[str, Any], Path]) -> None:
    out, root = run
    line = out["refused"]
    assert line is not None and "\n" not in line
    assert f"checkpoint {root / 'ck' / 'iter_0000003'} not written: parameter " in line, line
    assert f"the newest complete checkpoint {root / 'ck' / 'iter_0000001'} stays the resume point" in line, line
    assert out["left"] == ["iter_0000001", "latest_checkpointed_iteration.txt"], out["left"]
    assert out["loaded_step"] == 1


def test_a_checkpoint_before_any_applied_update_resumes(run: tuple[dict[str, Any], Path]) -> None:
    """Every update before the first save skipped: the optimizer saved no moments; the load (a resume) takes
    the fresh ones (a KeyError on ``optimizer.state.exp_avg...`` before) and the next update applies."""
    got = run[0]["skipped_resume"]
    assert got["skipped"] == 1.0 and got["step"] == 1 and got["same"]
    assert got["next"]["skipped"] == 0.0 and math.isfinite(got["next"]["grad_norm"])


def test_the_driver_stops_after_refused_updates_in_a_row() -> None:
    from mindspeed_rl.config.grpo import GRPOConfig
    from mindspeed_rl.driver.runner import GRPORunner

    config = GRPOConfig()
    config.train.max_nonfinite_steps = 2
    runner = SimpleNamespace(
        config=config, ctx=SimpleNamespace(step=5), checkpoint_path=lambda: Path("/r/iter_0000004")
    )
    assert not GRPORunner._diverged(runner, {"nonfinite_streak": 1.0}) and not hasattr(runner, "failed")
    assert GRPORunner._diverged(runner, {"nonfinite_streak": 2.0})
    assert runner.failed.startswith("2 consecutive actor updates with a non-finite loss or gradient norm")
    assert "(train.max_nonfinite_steps=2), the last at actor update 5" in runner.failed
    assert "lower actor.lr" in runner.failed and "it resumes from /r/iter_0000004" in runner.failed
