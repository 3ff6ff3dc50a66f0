"""The training loop of ``mindspeed-mm train`` for vision-language models, on every rank.

Order of construction (as torchtitan): load the Hugging Face model in fp32, freeze parts,
recompute, FSDP2 over the data-parallel mesh, then the optimizer over the sharded trainable
parameters; resume from the newest complete checkpoint; train; export.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.progress import StatusProgress
from mindspeed_llm.training.metrics import LOSS_CURVE, METRICS_FILE, MetricsLog, write_loss_curve
from mindspeed_mm.config import MMConfig
from mindspeed_mm.data.encode import EncodedSample, encode_sample
from mindspeed_mm.data.mllm import read_mllm_files
from mindspeed_mm.data.order import SampleOrder
from mindspeed_mm.data.packing import PackedBatch, pack_samples
from mindspeed_mm.models import family_of, freeze_parts, load_model, load_processing
from mindspeed_mm.models.loading import build_meta_model
from mindspeed_mm.trainer.checkpoint import load_checkpoint, newest_checkpoint, save_checkpoint
from mindspeed_mm.trainer.export import save_hf
from mindspeed_mm.trainer.fsdp import apply_fsdp, apply_recompute, build_mesh
from mindspeed_mm.trainer.loss import reduce_loss, token_losses
from mindspeed_mm.trainer.optim import build_optimizer, clip_gradients, lr_at, set_lr
from mindspeed_mm.trainer.vision_sync import VisionSync

logger = get_logger(__name__)


@dataclass
class TrainResult:
    """What a run did (rank 0's view).

    Attributes:
        records: the step records written to metrics.jsonl (``loss``, ``grad_norm``, ``lr``, ...).
        start_step: the step the run resumed after (0: a fresh run).
        checkpoint: the last checkpoint written (None: none).
        save_hf: the Hugging Face export (None: none).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0
    checkpoint: str | None = None
    save_hf: str | None = None


class _Batches:
    """Encodes samples on first use and packs the microbatches of a step."""

    def __init__(self, config: MMConfig, family: Any, model: torch.nn.Module, world: int) -> None:
        d = config.data
        self.config, self.family, self.model = config, family, model
        self.vision_sync = VisionSync(model, family) if world > 1 else None
        self.samples = read_mllm_files(d.files, d.image_dir, d.max_samples)
        self.tokenizer, self.processor = load_processing(config.model.path, d.image_min_pixels, d.image_max_pixels)
        t = config.train
        self.order = SampleOrder(len(self.samples), t.micro_batch_size, t.gradient_accumulation_steps, world, t.seed,
                                 d.shuffle)
        self._encoded: dict[int, EncodedSample] = {}

    def encoded(self, index: int) -> EncodedSample:
        if index not in self._encoded:
            d = self.config.data
            self._encoded[index] = encode_sample(self.samples[index], self.tokenizer, self.processor, self.family,
                                                 d.cutoff_len, d.train_on_prompt, d.mask_history)
        return self._encoded[index]

    def step(self, step: int, rank: int) -> list[PackedBatch]:
        return [pack_samples([self.encoded(i) for i in self.order.indices(step, rank, j)], self.model, self.family)
                for j in range(self.config.train.gradient_accumulation_steps)]


def build_model(config: MMConfig, world: int) -> tuple[Any, torch.nn.Module]:
    """The family and its model, frozen, recomputed and sharded as the recipe says.

    With several ranks only rank 0 reads the weights (on the host); every rank builds the model
    on the meta device, shards it, and receives its shards from rank 0 (the buffers, such as
    rotary frequencies that are in no checkpoint, too), so no other rank holds a full copy.
    """
    m, p = config.model, config.parallel
    family = family_of(m.path)
    device = get_accelerator().device()
    full_state, buffers = None, None
    if world == 1:
        model = load_model(m.path, family, m.attn_implementation).to(device)
    else:
        if dist.get_rank() == 0:
            loaded = load_model(m.path, family, m.attn_implementation)
            full_state, buffers = loaded.state_dict(), dict(loaded.named_buffers())
            del loaded
        model = build_meta_model(m.path, family, m.attn_implementation)
    freeze_parts(model, family, m.freeze)
    apply_recompute(model, config.train.recompute_modules)
    mesh = build_mesh(world, p.dp_replicate)
    apply_fsdp(model, p.fsdp_plan if p.fsdp_plan is not None else family.fsdp_plan, mesh, config.train.precision,
               p.reshard_after_forward)
    if world > 1:
        _load_from_rank0(model, full_state, buffers, device)
    model.train()
    return family, model


def _load_from_rank0(model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None,
                     buffers: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(model, full_state or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if buffers is not None:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)


def _step_counts(batches: list[PackedBatch], device: torch.device) -> tuple[int, int, int]:
    counts = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in batches:
        mask = batch.targets != -100
        per_sample = torch.zeros(batch.num_samples).index_add(0, batch.sample_index, mask.float())
        counts += torch.tensor([float(mask.sum()), float((per_sample > 0).sum()), float(batch.input_ids.numel())],
                               dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    tokens, samples, seen = (int(x) for x in counts.tolist())
    return tokens, samples, seen


def train(config: MMConfig) -> TrainResult:
    """Train as ``config`` says on the ranks of the current process group; returns rank 0's :class:`TrainResult`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config.check(world)
    t, ck = config.train, config.checkpoint
    torch.manual_seed(t.seed)
    device = get_accelerator().device()
    family, model = build_model(config, world)
    batches = _Batches(config, family, model, world)
    optimizer = build_optimizer(t, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    result = TrainResult()
    resume_from = newest_checkpoint(ck.save) if ck.resume else None
    if resume_from is not None:
        result.start_step = int(load_checkpoint(resume_from, model, optimizer)["step"])
    log_dir = config.log_dir()
    metrics = MetricsLog(log_dir, result.start_step, enabled=rank == 0, tensorboard=config.logging.tensorboard)
    bar = StatusProgress("train", total=t.steps, disable=not (rank == 0 and config.logging.progress))
    with bar:
        if result.start_step:
            bar.update(advance=result.start_step, status="resumed")
        for step in range(result.start_step + 1, t.steps + 1):
            record = _train_step(config, step, rank, world, model, optimizer, trainable, batches, device)
            metrics.write(record)
            result.records.append(record)
            status = f"loss {record['loss']:.4f} lr {record['lr']:.3g} gnorm {record['grad_norm']:.3f}"
            bar.update(status=status)
            if step % config.logging.interval == 0:
                logger.info("step %d/%d: %s %.0f tok/s", step, t.steps, status, record["tokens_per_s"])
            if ck.save and ((ck.interval and step % ck.interval == 0) or (step == t.steps and ck.save_at_end)):
                result.checkpoint = str(save_checkpoint(ck.save, step, model, optimizer, ck.keep_last))
    metrics.close()
    if ck.save_hf:
        exported = save_hf(model, config.model.path, ck.save_hf)
        result.save_hf = str(exported) if exported is not None else None
    if rank == 0 and log_dir is not None and config.logging.loss_curve:
        write_loss_curve(log_dir / METRICS_FILE, log_dir / LOSS_CURVE)
    return result


def _train_step(config: MMConfig, step: int, rank: int, world: int, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, trainable: list[torch.Tensor], batches: _Batches,
                device: torch.device) -> dict[str, Any]:
    t = config.train
    start = time.perf_counter()
    micro = batches.step(step, rank)
    tokens, samples, seen = _step_counts(micro, device)
    lr = lr_at(t, step)
    set_lr(optimizer, lr)
    reported = torch.zeros((), dtype=torch.float32, device=device)
    for batch in micro:
        if batches.vision_sync is not None:
            batches.vision_sync.needed = batch.pixel_values is None
        logits = model(**batch.model_inputs(device)).logits[0]
        targets = batch.targets.to(device)
        losses = token_losses(logits, targets)
        loss, share = reduce_loss(losses, targets, batch.sample_index.to(device), batch.num_samples, t.loss_type,
                                  t.gradient_accumulation_steps, world, tokens, samples)
        loss.backward()
        reported += share
    dist.all_reduce(reported)
    grad_norm = clip_gradients(trainable, t.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return {"kind": "train", "step": step, "loss": float(reported), "lr": lr, "grad_norm": grad_norm,
            "tokens": seen, "label_tokens": tokens, "samples": samples, "step_time_s": seconds,
            "tokens_per_s": seen / seconds if seconds > 0 else None, "skipped": False}
