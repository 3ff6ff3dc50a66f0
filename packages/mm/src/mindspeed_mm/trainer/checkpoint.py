"""Training checkpoints: torch DCP (every rank writes its shards), one directory per step, through the core's
shared checkpoint reliability (:mod:`mindspeed.checkpointing`, see docs/reliability.md).

``SAVE/step_00000010/`` holds the model's and the optimizer's sharded state (DCP's files),
``trainer_state.json`` (the step, the random-number state and the model's class; the data order
and the learning rate follow from the step) and, written last, ``complete.json`` (every file
with its size). Ranks write into ``step_00000010.tmp``; once every rank is done rank 0 marks it
complete, renames it and moves the tracker (``latest_checkpointed_iteration.txt``), as the LLM
trainer does. A run resumes from the newest *complete* checkpoint found by scanning ``SAVE``:
damaged newer ones are skipped with one warning each, and a ``SAVE`` holding checkpoints but no
complete one is an error unless ``checkpoint.resume`` is false. Rotation (``keep_last``) counts
and deletes complete checkpoints only.

With ``trainable_only`` (LoRA runs) the model entries are the trainable parameters alone (the
adapter's factors): the frozen base is the one ``model.path`` holds, and a resume loads it from
there before it loads the factors and their optimizer state from the checkpoint.

Nothing read from a checkpoint runs code (docs/reliability.md, "Trust"): the trainer state is
JSON, DCP's ``.metadata`` is read by the core's restricted unpickler and its non-tensor items
weights-only (:mod:`mindspeed.checkpointing.trust`); a ``trainer_state.pt`` of an older
checkpoint is loaded weights-only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from mindspeed.checkpointing import (
    STEP,
    NonFiniteState,
    fault_armed,
    fault_point,
    find_resume,
    first_nonfinite_everywhere,
    holds_checkpoints,
    list_complete,
    plant_nan,
    refused_save,
    remove_tree,
    rotate,
    save_guard,
    write_marker,
    write_tracker,
)
from mindspeed.checkpointing.trust import SafeFileSystemReader, SafeLoadPlanner, load_torch_file, read_dcp_metadata
from mindspeed.config import ConfigError
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger

logger = get_logger(__name__)

STATE_FILE = "trainer_state.json"
#: The trainer state of checkpoints written before it was JSON (read weights-only).
LEGACY_STATE_FILE = "trainer_state.pt"
#: The learning-rate schedule the checkpoint was trained with (JSON), for the resume check.
SCHEDULE_FILE = "schedule.json"
#: ``step_00000010``: the step directories' names.
LAYOUT = STEP


def step_dir(save: str | Path, step: int) -> Path:
    """The directory of step ``step``'s checkpoint."""
    return LAYOUT.dir(save, step)


def newest_checkpoint(save: str | Path | None) -> Path | None:
    """The newest complete checkpoint in ``save`` (None: there is none); damaged newer ones are skipped with a warning."""
    if save is None or not Path(save).is_dir():
        return None
    return find_resume(save, warn=dist.get_rank() == 0 if dist.is_initialized() else True, layout=LAYOUT).path


def model_class(source: str | Path) -> str | None:
    """The class a model directory's ``config.json`` names (transformers' ``architectures``, diffusers' ``_class_name``)."""
    try:
        config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("_class_name") or (config.get("architectures") or [None])[0] or config.get("model_type")


def find_resume_checkpoint(save: str | None, resume: bool) -> Path | None:
    """The checkpoint a run resumes from: the newest complete one in ``save`` (``None``: start at step 1).

    Raises:
        ConfigError: ``save`` holds checkpoints but none is complete, and ``resume`` is true.
    """
    if not save:
        return None
    rank0 = dist.get_rank() == 0
    if not resume:
        if holds_checkpoints(save, LAYOUT) and rank0:
            logger.warning(
                "checkpoint.resume=false: training from step 1; the checkpoints in %s are replaced as this run saves",
                save,
            )
        return None
    found = find_resume(save, warn=rank0, layout=LAYOUT)
    if found.path is None and holds_checkpoints(save, LAYOUT):
        damaged = "; ".join(f"{path.name}: {why}" for path, why in found.skipped) or "no step_* directory"
        raise ConfigError(
            f"checkpoint.save={save!r} holds checkpoints but none is complete ({damaged}); set "
            "checkpoint.resume=false to train from step 1 there (its checkpoints are replaced as the "
            "run saves) or set checkpoint.save to a new directory"
        )
    return found.path


def save_checkpoint(
    save: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    keep_last: int | None = None,
    source: str | Path | None = None,
    trainable_only: bool = False,
    schedule: dict[str, Any] | None = None,
    counters: dict[str, int] | None = None,
) -> Path:
    """Write step ``step``'s checkpoint (a collective: every rank calls it); returns its directory.

    ``source`` is the model directory the run started from: its model class is recorded, so that a
    resume with another model is one clear error. ``trainable_only``: the model entries are the
    parameters that train (LoRA: the factors), the frozen rest is ``source``'s. ``schedule``: the
    learning-rate schedule's settings (``optim.schedule_of``), recorded as ``schedule.json``.
    ``counters``: the skipped steps (``skipped_steps``, ``nonfinite_streak``) recorded in the trainer state.

    Raises:
        DiskFullError: the file system ran out of space (one line; the ``.tmp`` directory is removed).
        NonFiniteState: a parameter or an optimizer tensor of some rank holds NaN/Inf (every rank
            raises it, before anything is written: the newest complete checkpoint stays the resume point).
    """
    root = Path(save)
    with save_guard(root, step_dir(root, step), remove_tmp=dist.get_rank() == 0, layout=LAYOUT):
        return _save_checkpoint(save, step, model, optimizer, keep_last, source, trainable_only, schedule, counters)


def _save_checkpoint(
    save: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    keep_last: int | None,
    source: str | Path | None,
    trainable_only: bool,
    schedule: dict[str, Any] | None,
    counters: dict[str, int] | None,
) -> Path:
    root = Path(save)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if fault_armed("save.param_nan", step) and rank0:
        plant_nan(next(iter(model.parameters())))
    bad = first_nonfinite_everywhere(_named_state(model, optimizer), device=get_accelerator().device())
    if bad is not None:
        complete = list_complete(root, LAYOUT) if root.is_dir() else []
        raise NonFiniteState(refused_save(final, bad, complete[-1] if complete else None))
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{LAYOUT.prefix}*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    fault_point("save.start", step)
    model_state, optim_state = get_state_dict(model, optimizer)
    if trainable_only:
        model_state = _trainable(model, model_state)
    fault_point("save.write", step)  # a test's ENOSPC (save.write@N=ENOSPC)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    dist.barrier()
    fault_point("save.written", step)
    if rank0:
        state = {
            "step": step,
            "rng": torch.get_rng_state().numpy().tobytes().hex(),  # torch's CPU generator state, bytes
            "model_class": model_class(source) if source is not None else None,
            "trainable_only": trainable_only,
            **(counters or {}),
        }
        (tmp / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
        if schedule is not None:
            (tmp / SCHEDULE_FILE).write_text(json.dumps(schedule), encoding="utf-8")
        write_marker(tmp, step)  # last: from here on the checkpoint is complete
        if final.exists():  # the same step saved again (a resumed run that re-reached it, or a damaged one)
            remove_tree(final)
        tmp.rename(final)
        fault_point("save.renamed", step)
        write_tracker(root, step)
        fault_point("save.tracker", step)
        rotate(root, keep_last, final, LAYOUT)
    dist.barrier()
    logger.info("saved checkpoint %s", final)
    return final


def read_schedule(path: Path) -> dict[str, Any] | None:
    """The schedule settings checkpoint ``path`` records (``None``: an older checkpoint without them)."""
    try:
        data = json.loads((path / SCHEDULE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    source: str | Path | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Restore the model and optimizer from ``path`` (a collective); returns its trainer state.

    ``trainable_only``: restore the parameters that train only (LoRA: the factors; the frozen
    base is already ``source``'s), from a checkpoint with or without the frozen ones.

    Raises:
        ConfigError: the checkpoint holds another model (its class, a parameter it lacks, or a
            parameter of another shape), or cannot be read (one line naming it and the fix).
    """
    trainer_state = read_trainer_state(path)
    saved, recipe = trainer_state.get("model_class"), model_class(source) if source is not None else None
    if saved and recipe and saved != recipe:
        raise ConfigError(
            f"checkpoint {path} holds a {saved} model and model.path={str(source)!r} is a {recipe}; "
            "set checkpoint.save to a new directory (or checkpoint.resume=false) to train this model, "
            "or model.path to the one the checkpoint was trained from"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    if trainable_only:
        model_state = _trainable(model, model_state)
    _check_shapes(path, model_state)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    except Exception as err:  # DCP's CheckpointException carries every rank's traceback: keep its last line
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"checkpoint {path} cannot be read ({last}); delete it to resume from the previous "
            "complete checkpoint, or set checkpoint.resume=false"
        ) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=not trainable_only),
    )
    torch.set_rng_state(trainer_state["rng"])
    logger.info("resumed from %s at step %d", path, trainer_state["step"])
    return trainer_state


def _named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """This rank's tensors of a checkpoint: the (sharded) parameters and the optimizer's state."""
    names = {}
    for name, param in model.named_parameters():
        names[id(param)] = name
        yield f"parameter {name}", param
    for param, state in optimizer.state.items():
        for key, value in state.items():
            yield f"optimizer {key} of {names.get(id(param), 'a parameter')}", value


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (``rng`` as torch's generator state), read without running code.

    Raises:
        ConfigError: the file is missing or damaged, or (an older ``trainer_state.pt``) holds a
            class torch's weights-only loader refuses.
    """
    legacy = path / LEGACY_STATE_FILE
    if not (path / STATE_FILE).is_file() and legacy.is_file():
        state = load_torch_file(legacy)
        if not isinstance(state, dict) or not torch.is_tensor(state.get("rng")):
            raise ConfigError(f"checkpoint file {legacy} is no trainer state; the checkpoint is damaged")
        return state
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        state["rng"] = torch.frombuffer(bytearray.fromhex(state["rng"]), dtype=torch.uint8)
        state["step"] = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"checkpoint file {path / STATE_FILE} is unreadable ({type(err).__name__}); delete the checkpoint "
            "to resume from the previous complete one, or set checkpoint.resume=false"
        ) from None
    return state


def _trainable(model: torch.nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``model_state`` that are parameters with gradients."""
    names = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: value for name, value in model_state.items() if name in names}


def _check_shapes(path: Path, model_state: dict[str, Any]) -> None:
    """One line naming the first parameter the checkpoint lacks or holds with another (global) shape."""
    saved = read_dcp_metadata(path).state_dict_metadata
    for name, value in model_state.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise ConfigError(
                f"checkpoint {path} holds no parameter {name}: it is a checkpoint of another model "
                "or recipe (LoRA, frozen parts); set checkpoint.save to a new directory or restore "
                "the recipe it was trained with"
            )
        shape = list(getattr(meta, "size", []))
        if torch.is_tensor(value) and shape != list(value.shape):
            raise ConfigError(
                f"checkpoint {path}: parameter {name} has shape {shape} there and "
                f"{list(value.shape)} in this recipe; set checkpoint.save to a new directory or "
                "model.path to the model the checkpoint was trained from"
            )
