"""Training checkpoints in megatron-core's distributed format, written atomically.

Layout, as megatron's own training writes it::

    SAVE/latest_checkpointed_iteration.txt     the newest complete step
    SAVE/iter_0000100/                         dist_checkpointing (torch_dist) + config.yaml

One checkpoint holds the model (``model``, or ``model0``, ``model1`` ... with virtual pipeline
stages), the optimizer (``fully_reshardable``: loadable at another TP/PP/DP layout), the
learning-rate schedule, every rank's random-number generators, the data position (consumed
samples) and the recipe. It is written into ``iter_XXXXXXX.tmp`` and renamed when every rank
has finished; the tracker file is then replaced (temporary file + rename). The rank-0 process
writes ``complete.json`` (every file with its size, :mod:`mindspeed.checkpointing`) last,
before the rename: a resumed run takes the newest checkpoint whose files all match it, skipping
(with one warning each) any newer one that was damaged, and never trusts the tracker alone.
Megatron's writer forks processes; they die with their trainer (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import random
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from mindspeed.checkpointing import (
    MARKER,
    TRACKER,
    NonFiniteState,
    checkpoint_dir,
    damage_of,
    fault_armed,
    fault_point,
    find_resume,
    first_nonfinite_everywhere,
    forked_children_die_with_me,
    list_complete,
    plant_nan,
    refused_save,
    remove_tree,
    resolve_schedule,
    rotate,
    save_guard,
    write_marker,
    write_tracker,
)
from mindspeed.checkpointing.schedule import Winner
from mindspeed.config import ConfigError, to_dict
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger, get_rank, logged_as_detail
from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.megatron.trusted_load import check_dist_checkpoint, trusted_dist_loads
from mindspeed.patching import PatchSet, UpstreamPatch
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.model import unwrap
from mindspeed_llm.training.optim import schedule_settings

logger = get_logger(__name__)

__all__ = [
    "TRACKER",
    "TrainState",
    "checkpoint_dir",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
#: Optimizer sharding that megatron-core 0.16 can reshard across TP / PP / DP (its default
#: type is deprecated and fails with "ShardedTensor.flattened_range is not supported").
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass
class TrainState:
    """Where training stands: everything besides tensors that a resume needs.

    Attributes:
        step: optimizer steps taken (skipped non-finite steps included).
        consumed_train_samples: global samples read so far (the data position).
        skipped_steps: steps whose update was refused (a non-finite loss or gradient norm).
        nonfinite_streak: consecutive steps refused for a non-finite loss or gradient norm at the end.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_steps: int = 0
    nonfinite_streak: int = 0


def find_checkpoint(path: str | Path, what: str = "checkpoint.load") -> Path:
    """The checkpoint ``path`` names: one ``iter_*`` directory, or a save directory's newest complete one.

    A damaged newest checkpoint of a save directory is skipped with one warning. Checkpoints of
    other writers (``convert-ckpt``, megatron itself) have no completeness marker: in a
    directory without any marked checkpoint, the tracker's step is taken as megatron does.

    Args:
        path: the directory.
        what: the setting that named it, for error messages.

    Raises:
        ValueError: ``path`` is not a checkpoint, or a damaged one (the message names the
            damage and the newest complete checkpoint next to it).
    """
    path = Path(path)
    if (path / "metadata.json").is_file():
        if (path / MARKER).is_file() and (why := damage_of(path)) is not None:
            raise ConfigError(f"{what}={str(path)!r} is damaged: {why}; {_complete_hint(path.parent, what)}")
        return path
    if not path.is_dir():
        raise ConfigError(
            f"{what}={str(path)!r} does not exist; name a checkpoint directory (iter_*) or a "
            "checkpoint.save directory that holds one"
        )
    found = find_resume(path, warn=get_rank() == 0)
    if found.path is not None:
        return found.path
    tracker = path / TRACKER
    if tracker.is_file() and not any((p / MARKER).is_file() for p in path.glob("iter_*")):
        text = tracker.read_text().strip()
        if text.isdigit() and (checkpoint_dir(path, int(text)) / "metadata.json").is_file():
            return checkpoint_dir(path, int(text))
    if found.skipped:
        damaged, why = found.skipped[0]
        raise ConfigError(
            f"{what}={str(path)!r} holds no complete checkpoint ({damaged.name}: {why}); "
            "name an intact one or start without it"
        )
    raise ConfigError(
        f"{what}={str(path)!r} is not a checkpoint: it holds neither an iter_* directory with "
        f"metadata.json nor {TRACKER}; name a checkpoint directory or a checkpoint.save directory"
    )


def _complete_hint(root: Path, what: str) -> str:
    complete = list_complete(root)
    if complete:
        return f"the newest complete checkpoint next to it is {complete[-1]}: set {what} to it"
    return "no complete checkpoint is next to it"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root`` (their marker lists every file at its size), oldest first."""
    return list_complete(root)


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": get_accelerator().get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["device"])
    get_cuda_rng_tracker().set_states(state["tracker"])


#: ``model_contents`` of the common state of a checkpoint that holds the LoRA factors and not the base.
ADAPTERS = "adapters"


def _model_state(chunks: list[Any], adapters_only: bool = False) -> dict[str, Any]:
    """The chunks' sharded state dicts (only their LoRA factors with ``adapters_only``)."""
    from mindspeed_llm.training.lora import split_lora_state

    states = [unwrap(chunk).sharded_state_dict() for chunk in chunks]
    if adapters_only:
        states = [split_lora_state(state)[1] for state in states]
    return dict(zip(_model_keys(len(chunks)), states))


def _base_sums(chunks: list[Any]) -> list[float]:
    """A fingerprint of this rank's frozen weights (an adapters-only checkpoint's base): each one's float64 sum."""
    return [
        float(param.detach().double().sum())
        for chunk in chunks
        for param in unwrap(chunk).parameters()
        if not param.requires_grad
    ]


def _check_base(path: Path, saved: list[float], chunks: list[Any]) -> None:
    """Raise on every rank when some rank's frozen weights differ from those an adapters-only checkpoint was trained on."""
    ours = _base_sums(chunks)
    same = len(saved) == len(ours) and all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(saved, ours))
    flag = torch.tensor([0.0 if same else 1.0], device=get_accelerator().device())
    dist.all_reduce(flag)
    if float(flag) > 0:
        raise ConfigError(
            f"checkpoint {path} holds LoRA adapters trained on other base weights than this model's; "
            f"give the base model the run started from (its recipe: {path / 'config.yaml'})"
        )


def _layout(config: PretrainConfig) -> dict[str, Any]:
    p = config.parallel
    return {
        "world_size": dist.get_world_size(),
        "tp": p.tp,
        "pp": p.pp,
        "vpp": p.vpp,
        "ep": p.ep,
        "distributed_optimizer": p.distributed_optimizer,
    }


def _local_results_queue() -> UpstreamPatch:
    return UpstreamPatch(
        name="checkpoint-local-results-queue",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue",
        make=lambda original, accelerator: queue.Queue(),
        distribution="megatron-core",
        versions=MEGATRON_VERSIONS,
        reason="megatron collects the writers' results through a queue served by a spawned Manager process, "
        "which outlives a rank killed with SIGKILL; a synchronous save collects them in the rank itself",
    )


@contextlib.contextmanager
def _synchronous_save() -> Iterator[None]:
    """The conditions of a synchronous ``dist_checkpointing.save`` from any rank (see the two helpers)."""
    patches = PatchSet([_local_results_queue()])
    patches.apply(get_accelerator())
    try:
        with _children_allowed():
            yield
    finally:
        patches.revert()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    # dist_checkpointing's writer forks one process per file bucket, even for a synchronous save;
    # daemonic processes (ranks started by a process pool or a test harness) may not have
    # children. The writers are joined before save() returns.
    process = multiprocessing.current_process()
    daemon = process.daemon
    if daemon:
        process.daemon = False
    try:
        yield
    finally:
        if daemon:
            process.daemon = True


_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def write_checkpoint(
    root: Path,
    final: Path,
    tmp: Path,
    state: TrainState,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    config: PretrainConfig,
    args: Any,
    extra_files: dict[str, str] | None,
    async_save: bool = False,
    adapters_only: bool = False,
) -> Any:
    """Write the checkpoint of ``state`` into ``tmp`` and complete it as ``final``; collective.

    ``async_save``: plan the save (collectives) and write the common state here, then return
    megatron's ``AsyncRequest`` whose files the caller writes and completes later
    (:mod:`mindspeed_llm.training.async_save`); ``None`` otherwise. ``adapters_only``: the model's
    LoRA factors and not its frozen base (see :func:`save_checkpoint`).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("iter_*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    fault_point("save.start", state.step)
    sharded = _model_state(chunks, adapters_only)
    if adapters_only and not any(sharded.values()):
        raise ValueError(
            "an adapters-only checkpoint of a model without LoRA factors; apply LoRA or save the whole model"
        )
    sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=False, metadata=OPTIMIZER_METADATA)
    sharded["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    if adapters_only:  # what a resume checks the base it rebuilt against (at the same layout)
        sharded["base_sums"] = ShardedObject("base_sums", _base_sums(chunks), (world,), (rank,), replica_id=0)
    sharded.update(
        train_state=asdict(state),
        # The warmup's start too (megatron's state leaves it out): a resume compares it with the recipe's.
        opt_param_scheduler={**scheduler.state_dict(), "init_lr": scheduler.init_lr},
        layout=_layout(config),
        config=to_dict(config),
        model_contents=ADAPTERS if adapters_only else "full",
    )
    if args is not None:
        import copy

        args = copy.copy(args)
        args.iteration = state.step
        sharded["args"] = args
    # A writer's failure (a full disk) is reported by save_guard in one line, not by megatron's ERROR line too.
    with _synchronous_save(), forked_children_die_with_me(), logged_as_detail(_WRITER_LOGGER, errors=True):
        request = dist_checkpointing.save(sharded, str(tmp), async_sharded_save=async_save)
    if async_save:
        return request
    complete_checkpoint(root, final, state.step, config, extra_files)
    return None


def complete_checkpoint(
    root: Path, final: Path, step: int, config: PretrainConfig, extra_files: dict[str, str] | None = None
) -> None:
    """After every rank's files of ``final.tmp`` are written: the marker, the rename and the tracker (rank 0); collective."""
    tmp = final.with_name(final.name + ".tmp")
    dist.barrier()
    fault_point("save.written", step)
    if dist.get_rank() == 0:
        (tmp / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_marker(tmp, step)  # last: from here on the checkpoint is complete
        if final.exists():  # the same step saved again (a resumed run that re-reached it, or a damaged one)
            remove_tree(final)
        tmp.rename(final)
        fault_point("save.renamed", step)
        write_tracker(root, step)
        fault_point("save.tracker", step)


def save_checkpoint(
    root: str | Path,
    state: TrainState,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    config: PretrainConfig,
    args: Any = None,
    extra_files: dict[str, str] | None = None,
    keep_last: int | None = None,
    adapters_only: bool = False,
) -> Path:
    """Save everything a resume needs as ``root/iter_<step>``; atomic, collective.

    Args:
        root: the ``checkpoint.save`` directory.
        state: the train state to record.
        chunks: this rank's model chunks.
        optimizer: megatron's optimizer.
        scheduler: the learning-rate scheduler.
        config: the recipe (stored as ``config.yaml`` and in the common state).
        args: megatron-style ``args`` naming the model (bridge family, shape, layout), stored in
            the common state as converted checkpoints store them, so that ``convert-ckpt`` and
            the inference engine read the trainer's checkpoints too.
        extra_files: ``{name: text}`` written into the checkpoint before it is marked complete
            (the RL driver's run state).
        keep_last: rotation (default ``config.checkpoint.keep_last``): only complete
            checkpoints are counted and deleted, never the newest complete one nor this one.
        adapters_only: of a LoRA model, save its factors (with their optimizer state, the
            schedule and the RNG) and not the frozen base weights, which a resume reads again
            from their source before :func:`load_checkpoint` (recorded as ``model_contents:
            adapters`` in the common state; :func:`load_checkpoint` then loads the factors only).

    Returns:
        The checkpoint directory.


    Raises:
        NonFiniteState: a parameter or an optimizer tensor of some rank holds NaN/Inf (every rank
            raises it, before anything is written: the newest complete checkpoint stays the resume point).
        DiskFullError: the file system ran out of space (the ``.tmp`` directory is removed).
    """
    root, rank = Path(root), dist.get_rank()
    final = check_savable(root, state.step, chunks, optimizer)
    tmp = final.with_name(final.name + ".tmp")
    # A full disk anywhere in here (the forked writers included) is one line, and the .tmp goes.
    with save_guard(root, final, remove_tmp=rank == 0):
        write_checkpoint(
            root,
            final,
            tmp,
            state,
            chunks,
            optimizer,
            scheduler,
            config,
            args,
            extra_files,
            adapters_only=adapters_only,
        )
    if rank == 0:
        rotate(root, config.checkpoint.keep_last if keep_last is None else keep_last, final)
    dist.barrier()
    logger.info("saved checkpoint %s", final)
    return final


def check_savable(root: Path, step: int, chunks: list[Any], optimizer: Any) -> Path:
    """The directory the checkpoint of ``step`` goes to, once every rank's state is finite; collective.

    Raises:
        NonFiniteState: a parameter or an optimizer tensor of some rank holds NaN/Inf.
    """
    final = checkpoint_dir(root, step)
    if fault_armed("save.param_nan", step) and dist.get_rank() == 0:
        plant_nan(next(iter(unwrap(chunks[0]).parameters())))
    bad = first_nonfinite_everywhere(_named_state(chunks, optimizer), device=get_accelerator().device())
    if bad is not None:
        complete = list_complete(root) if root.is_dir() else []
        raise NonFiniteState(refused_save(final, bad, complete[-1] if complete else None))
    return final


def _named_state(chunks: list[Any], optimizer: Any) -> Iterator[tuple[str, Any]]:
    """This rank's tensors of a checkpoint: the chunks' parameters, the optimizer's main weights and state."""
    names: dict[int, str] = {}
    for i, chunk in enumerate(chunks):
        prefix = f"model{i}." if len(chunks) > 1 else ""
        for name, param in unwrap(chunk).named_parameters():
            names[id(param)] = prefix + name
            yield f"parameter {prefix}{name}", param
    # The torch optimizers megatron wraps: their parameters are the model's (fp32), the main fp32
    # copies (bf16), or this rank's shards of them (distributed optimizer); their state is Adam's moments.
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for g, group in enumerate(torch_optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                of = names.get(id(param), f"main weight {i} of group {g}")
                if id(param) not in names:
                    yield f"optimizer {of}", param
                for key, value in torch_optimizer.state.get(param, {}).items():
                    yield f"optimizer {key} of {of}", value


def load_checkpoint(
    path: Path,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    config: PretrainConfig,
    weights_only: bool = False,
    family: str | None = None,
) -> TrainState:
    """Restore a checkpoint written by :func:`save_checkpoint` (or any megatron dist checkpoint's model).

    Args:
        path: the ``iter_*`` directory.
        chunks: this rank's model chunks (any layout: the weights are resharded).
        optimizer: restored unless ``weights_only`` or ``checkpoint.load_optimizer`` is false.
        scheduler: its position is restored with the optimizer.
        config: the recipe.
        weights_only: take only the model weights and return a fresh :class:`TrainState`.
        family: the recipe's model family, checked against the one the checkpoint records.

    Returns:
        The restored train state.

    Raises:
        ValueError: the checkpoint is of another model family, or a parameter's shape differs
            from the recipe's (one line naming both), or a file in it holds something loading
            would execute (:class:`~mindspeed.checkpointing.trust.UntrustedFileError`: nothing
            from the checkpoint runs code, docs/reliability.md "Trust").
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ck = config.checkpoint
    check_dist_checkpoint(path)  # nothing in it runs code: a refused file is one line, before megatron reads it
    with trusted_dist_loads():
        common = dist_checkpointing.load_common_state_dict(str(path))
    adapters_only = common.get("model_contents") == ADAPTERS
    template = _model_template(path, common, chunks, family, weights_only)
    with_optimizer = not weights_only and ck.load_optimizer and "optimizer" in _saved_keys(common)
    winner = _schedule_winner(path, common, scheduler, config) if with_optimizer else None
    # An optimizer that never stepped (every update skipped as non-finite, or none yet) saved no
    # moments: the fresh one is the same; its schedule position is still restored.
    with_moments = with_optimizer and _holds_optimizer_state(path)
    if with_moments:
        template["optimizer"] = optimizer.sharded_state_dict(template, is_loading=True, metadata=OPTIMIZER_METADATA)
    layout = common.get("layout", {})
    with_rng = not weights_only and ck.load_rng and layout.get("world_size") == dist.get_world_size()
    with_base_check = adapters_only and layout == _layout(config)
    if with_base_check:
        template["base_sums"] = ShardedObject(
            "base_sums", None, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
        )
    if with_rng:
        template["rng_state"] = ShardedObject(
            "rng_state", None, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
        )
    elif not weights_only and ck.load_rng:
        logger.warning(
            "checkpoint %s was saved by %s ranks, this run has %d: random-number states are not restored",
            path,
            layout.get("world_size", "an unknown number of"),
            dist.get_world_size(),
        )
    with trusted_dist_loads():
        loaded = dist_checkpointing.load(template, str(path))
    if with_base_check:
        _check_base(path, loaded["base_sums"], chunks)
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        _load_model_state(unwrap(chunk), loaded[key], adapters_only)
    if weights_only:
        logger.info("loaded model weights from %s", path)
        return TrainState()
    if with_optimizer:
        built = [(group.get("max_lr"), group.get("min_lr")) for group in optimizer.param_groups]
        recipe = (scheduler.max_lr, scheduler.min_lr)
        if with_moments:
            optimizer.load_state_dict(loaded["optimizer"])
        _load_schedule(scheduler, optimizer, loaded["opt_param_scheduler"], winner, built, recipe)
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    state = TrainState(**loaded.get("train_state", {}))
    logger.info("resumed from %s at step %d (%d samples consumed)", path, state.step, state.consumed_train_samples)
    return state


def _model_template(
    path: Path, common: dict[str, Any], chunks: list[Any], family: str | None, weights_only: bool
) -> dict[str, Any]:
    """What :func:`load_checkpoint` loads of the model: all of it, its base (``weights_only``: a base
    checkpoint into a LoRA model) or its LoRA factors (an adapters-only checkpoint); shapes checked."""
    from mindspeed_llm.training.lora import split_lora_state

    saved_family = getattr(common.get("args"), "model_type_hf", None)
    if family is not None and saved_family is not None and saved_family != family:
        raise ConfigError(
            f"checkpoint {path} holds a {saved_family} model and this recipe builds a {family} model; "
            f"use a {family} checkpoint or the recipe the checkpoint was trained with "
            f"({path / 'config.yaml'})"
        )
    adapters_only = common.get("model_contents") == ADAPTERS
    template = _model_state(chunks, adapters_only)
    if adapters_only and not any(template.values()):
        raise ConfigError(
            f"checkpoint {path} holds LoRA adapters only and this model has none; build it with the LoRA "
            f"settings it was saved with ({path / 'config.yaml'}) on its base model"
        )
    with trusted_dist_loads():
        check_shapes(path, template)
    if weights_only and not adapters_only:
        # A base checkpoint has no LoRA factors: they keep their initial values.
        template = {key: split_lora_state(state)[0] for key, state in template.items()}
    return template


def save_model_checkpoint(
    root: str | Path,
    step: int,
    model: Any,
    extra_files: dict[str, str] | None = None,
    keep_last: int | None = None,
    adapters_only: bool = False,
) -> Path:
    """:func:`save_checkpoint` of a built model that holds its pieces (the RL actor and critic).

    Args:
        root: the checkpoint directory; written as ``root/iter_<step>``.
        step: the step to record (the train state's other counters start at 0).
        model: anything with ``chunks``, ``optimizer``, ``scheduler`` and ``config`` (the recipe).
        extra_files: written into the checkpoint before it is marked complete.
        keep_last: rotate complete checkpoints.
        adapters_only: a LoRA model's factors, not its frozen base (see :func:`save_checkpoint`).
    """
    state = TrainState(step=step)
    return save_checkpoint(
        root,
        state,
        model.chunks,
        model.optimizer,
        model.scheduler,
        model.config,
        extra_files=extra_files,
        keep_last=keep_last,
        adapters_only=adapters_only,
    )


def load_model_checkpoint(path: Path, model: Any, **checkpoint_flags: bool) -> int:
    """:func:`load_checkpoint` into a built model that holds its pieces; returns the restored step.

    Args:
        path: the ``iter_*`` directory.
        model: as for :func:`save_model_checkpoint`.
        checkpoint_flags: ``checkpoint`` section fields for this load (``override_scheduler``,
            ``use_checkpoint_scheduler``, ``load_optimizer``) over ``model.config``'s.
    """
    config = model.config
    if checkpoint_flags:
        config = replace(config, checkpoint=replace(config.checkpoint, **checkpoint_flags))
    return int(load_checkpoint(path, model.chunks, model.optimizer, model.scheduler, config).step)


def _schedule_winner(path: Path, common: dict[str, Any], scheduler: Any, config: PretrainConfig) -> Winner | None:
    """Whose learning-rate schedule a resume follows: one line listing the differences unless the recipe says."""
    saved = common.get("opt_param_scheduler")
    if not isinstance(saved, dict) or "max_lr" not in saved:
        return None
    ck = config.checkpoint
    decay = "train.lr_decay_steps" + (" (= train.steps)" if config.train.lr_decay_steps is None else "")
    theirs = schedule_settings(saved, decay_key=decay)
    ours = schedule_settings({**scheduler.state_dict(), "init_lr": scheduler.init_lr}, decay_key=decay)
    step = int(common.get("train_state", {}).get("step", saved.get("num_steps", 0)))
    return resolve_schedule(
        theirs,
        ours,
        path,
        step,
        override=ck.override_scheduler,
        use_checkpoint=ck.use_checkpoint_scheduler,
        announce=dist.get_rank() == 0,
    )


def _load_schedule(
    scheduler: Any,
    optimizer: Any,
    saved: dict[str, Any],
    winner: Winner | None,
    built: list[tuple[Any, Any]],
    recipe: tuple[float, float],
) -> None:
    """Restore the scheduler's position; its settings are the winner's (the recipe's when they agree).

    The optimizer's parameter groups carry the peak and final learning rates too (megatron's
    ``max_lr`` / ``min_lr``, ``built`` as the optimizer was built from the recipe's ``recipe``):
    they are set to the winner's, whatever the optimizer's own state brought back.
    """
    use_checkpoint = winner == "checkpoint"
    scheduler.override_opt_param_scheduler = not use_checkpoint
    scheduler.use_checkpoint_opt_param_scheduler = use_checkpoint
    scheduler.load_state_dict(saved)
    if use_checkpoint and saved.get("init_lr") is not None:
        scheduler.init_lr = saved["init_lr"]
    if len(built) == len(optimizer.param_groups):
        winners = (saved["max_lr"], saved["min_lr"]) if use_checkpoint else recipe
        for group, values in zip(optimizer.param_groups, built):
            for key, value, ours, theirs in zip(("max_lr", "min_lr"), values, recipe, winners):
                if value is not None:  # a group of the recipe's own rate follows the winner
                    group[key] = theirs if value == ours else value
    scheduler.step(0)  # the learning rate and weight decay of the restored position


def check_shapes(path: Path, template: dict[str, Any]) -> None:
    """Raise one line naming the first parameter whose shape in checkpoint ``path`` differs from ``template``'s."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = load_tensors_metadata(str(path))
    for tensor in nested_values(template):
        if not isinstance(tensor, ShardedTensor) or tensor.key not in saved:
            continue
        theirs, ours = tuple(saved[tensor.key].global_shape), tuple(tensor.global_shape)
        if theirs != ours:
            raise ConfigError(
                f"checkpoint {path}: parameter {tensor.key} has shape {list(theirs)} there and "
                f"{list(ours)} in this recipe; train with the recipe the checkpoint was saved with "
                f"({path / 'config.yaml'}) or set checkpoint.save to a new directory"
            )


def _model_keys(count: int) -> list[str]:
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def _load_model_state(model: torch.nn.Module, state: dict[str, Any], adapters_only: bool = False) -> None:
    # Strict, except for LoRA factors a base checkpoint does not hold, or the base an adapters-only one does not.
    from mindspeed_llm.training.lora import is_lora_key

    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if is_lora_key(k) == adapters_only and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint does not match the model: missing {missing[:6]}, unexpected {unexpected[:6]}"
        )


def _holds_optimizer_state(path: Path) -> bool:
    """Whether checkpoint ``path`` holds optimizer tensors (an optimizer that never stepped saves none)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    with trusted_dist_loads():
        return any(key.startswith("optimizer.") for key in load_tensors_metadata(str(path)))


def _saved_keys(common: dict[str, Any]) -> set[str]:
    # The common state lists what this trainer saved; other writers' checkpoints hold a model only.
    return {"optimizer"} if "opt_param_scheduler" in common else set()
