"""Training checkpoints: torch DCP (every rank writes its shards), one directory per step, written atomically.

``SAVE/step_00000010/`` holds the model's and the optimizer's sharded state (DCP's files) and
``trainer_state.pt`` (the step and the random-number state; the data order and the learning
rate follow from the step). Ranks write into ``step_00000010.tmp`` and rank 0 renames it once
every rank is done, so a directory without the suffix is complete; the newest complete one is
what a run resumes from. Kept small and separate from the loop: the core's shared checkpoint
discovery and preemption handling replaces the discovery here once it lands.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mindspeed.log import get_logger

logger = get_logger(__name__)

STATE_FILE = "trainer_state.pt"
_NAME = re.compile(r"step_(\d{8})\Z")


def step_dir(save: str | Path, step: int) -> Path:
    """The directory of step ``step``'s checkpoint."""
    return Path(save) / f"step_{step:08d}"


def newest_checkpoint(save: str | Path | None) -> Path | None:
    """The complete checkpoint of the highest step in ``save`` (None: there is none)."""
    if save is None or not Path(save).is_dir():
        return None
    done = [p for p in Path(save).iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(_NAME.match(p.name).group(1)), default=None)


def save_checkpoint(save: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    keep_last: int | None = None) -> Path:
    """Write step ``step``'s checkpoint (a collective: every rank calls it); returns its directory."""
    final = step_dir(save, step)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    if rank0:
        torch.save({"step": step, "rng": torch.get_rng_state()}, tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(Path(save), keep_last)
    dist.barrier()
    logger.info("saved checkpoint %s", final)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore the model and optimizer from ``path`` (a collective); returns its trainer state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_state = torch.load(path / STATE_FILE, weights_only=False)
    torch.set_rng_state(trainer_state["rng"])
    logger.info("resumed from %s (step %d)", path, trainer_state["step"])
    return trainer_state


def _prune(save: Path, keep_last: int | None) -> None:
    if keep_last is None:
        return
    done = sorted((p for p in save.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
