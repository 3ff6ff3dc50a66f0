"""Resuming with another learning-rate schedule: refused unless the recipe says which side wins, as megatron.

One spawned rank, the tiniest model. The old run trains 6 steps at ``train.lr=3e-3`` (warmup 2
from 1e-3, cosine to 1e-4) with a checkpoint at step 3. Its step-3 checkpoint is then resumed
with ``train.lr=1e-3``:

- without a flag: one line listing ``train.lr: checkpoint 0.003 vs recipe 0.001`` and both ways out
  (more ``train.steps``, which moves the decay's end, is listed the same way);
- ``checkpoint.override_scheduler=true``: steps 4-6 train with the learning rates a fresh scheduler
  of the new recipe has at positions 3-5 (not the old run's, not a mixture);
- ``checkpoint.use_checkpoint_scheduler=true``: steps 4-6 equal the uninterrupted old run's, learning
  rates and losses bit for bit;
- both flags: an error naming both.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from mindspeed.checkpointing import TRACKER
from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

OLD = [
    "data.seq_length=16",
    "data.split=1",
    "model.vocab_size=128",
    "model.num_layers=1",
    "model.hidden_size=16",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "train.steps=6",
    "train.micro_batch_size=2",
    "train.lr=3e-3",
    "train.min_lr=1e-4",
    "train.lr_warmup_steps=2",
    "train.lr_warmup_init=1e-3",
    "checkpoint.interval=3",
    "checkpoint.save_at_end=false",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.loss_curve=false",
]


def _copy_step3(old: Path, to: Path) -> str:
    shutil.copytree(old / "iter_0000003", to / "iter_0000003")
    (to / TRACKER).write_text("3")
    return str(to)


def _runs(rank: int, world_size: int, prefix: str, root: str) -> dict[str, Any]:
    from mindspeed.config import ConfigError
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.optim import build_scheduler, current_lr
    from mindspeed_llm.training.trainer import pretrain

    base = [f"data.prefixes=[{prefix}]", *OLD]

    def run(save: str, *extra: str) -> Any:
        return pretrain(load_pretrain_config(None, [*base, f"checkpoint.save={save}", *extra]))

    def error(save: str, *extra: str) -> str:
        try:
            run(save, *extra)
        except ConfigError as err:
            return str(err)
        raise AssertionError(f"{extra}: no error")

    out: dict[str, Any] = {"old": run(f"{root}/old").records}
    old = Path(root) / "old"
    out["refused"] = error(_copy_step3(old, Path(root) / "refused"), "train.lr=1e-3")
    out["longer"] = error(_copy_step3(old, Path(root) / "longer"), "train.steps=8")
    out["both"] = error(
        _copy_step3(old, Path(root) / "both"),
        "train.lr=1e-3",
        "checkpoint.override_scheduler=true",
        "checkpoint.use_checkpoint_scheduler=true",
    )
    out["override"] = run(
        _copy_step3(old, Path(root) / "override"), "train.lr=1e-3", "checkpoint.override_scheduler=true"
    ).records
    out["use_checkpoint"] = run(
        _copy_step3(old, Path(root) / "use"), "train.lr=1e-3", "checkpoint.use_checkpoint_scheduler=true"
    ).records

    # A fresh scheduler of the new recipe, on a stand-in optimizer: its learning rate at positions 3-5.
    class Groups:
        param_groups = [{"default_config": True}]

    new = load_pretrain_config(None, [*base, "train.lr=1e-3"])
    fresh = build_scheduler(new.train.scheduler_config(), Groups(), new.train.steps)
    fresh.step(3)
    expected = []
    for _ in range(3):
        expected.append(current_lr(Groups))
        fresh.step(1)
    out["fresh"] = expected
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume-schedule")
    prefix = write_indexed_dataset(root / "data" / "d", 60, seed=5)
    (result,) = run_distributed(_runs, 1, prefix, str(root), timeout=600)
    return result


def test_a_changed_schedule_is_refused_with_every_difference_and_both_ways_out(runs: dict[str, Any]) -> None:
    line = runs["refused"]
    assert "\n" not in line
    assert "was trained with another learning-rate schedule than the recipe's" in line
    assert "train.lr: checkpoint 0.003 vs recipe 0.001" in line
    assert "checkpoint.override_scheduler=true" in line and "checkpoint.use_checkpoint_scheduler=true" in line
    assert "min_lr" not in line and "warmup" not in line  # only what differs
    # More steps move the end of the decay (lr_decay_steps follows train.steps).
    assert "train.lr_decay_steps (= train.steps): checkpoint 6 vs recipe 8" in runs["longer"]
    both = runs["both"]
    assert "checkpoint.override_scheduler=true and checkpoint.use_checkpoint_scheduler=true" in both


def test_override_follows_a_fresh_schedule_of_the_recipe(runs: dict[str, Any]) -> None:
    old, got = runs["old"], runs["override"]
    assert [r["step"] for r in got] == [4, 5, 6]
    assert [r["lr"] for r in got] == pytest.approx(runs["fresh"], rel=1e-12)
    # The old run's rates were 3x higher: the recipe really won (the peak included, not only the shape).
    assert all(abs(r["lr"] - o["lr"]) > 1e-4 for r, o in zip(got, old[3:]))


def test_use_checkpoint_continues_the_old_run_bit_for_bit(runs: dict[str, Any]) -> None:
    old, got = runs["old"], runs["use_checkpoint"]
    assert [(r["step"], r["lr"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["lr"], r["loss"], r["grad_norm"]) for r in old[3:]
    ]
