"""The vision-language task: mllm_format data packed per microbatch, the model's logits, MindSpeed-MM's loss reductions."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing.hf_dtype import target_dtype
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_mm.config import MMConfig
from mindspeed_mm.data.encode import IGNORE_INDEX, EncodedSample
from mindspeed_mm.data.mllm import read_mllm_files
from mindspeed_mm.data.mllm_check import check_mllm_media
from mindspeed_mm.data.order import SampleOrder
from mindspeed_mm.data.packing import PackedBatch, pack_samples
from mindspeed_mm.data.preprocess import EncodeSettings, Processing, preprocess
from mindspeed_mm.data.video import VideoSettings
from mindspeed_mm.models import (
    family_of,
    freeze_parts,
    load_audio_processor,
    load_model,
    load_processing,
    load_video_processor,
)
from mindspeed_mm.models.loading import build_meta_model
from mindspeed_mm.models.lora import apply_lora, merged_state, write_adapter_config, write_peft_adapter
from mindspeed_mm.trainer.export import full_state, save_hf
from mindspeed_mm.trainer.fsdp import (
    apply_fsdp,
    apply_recompute,
    apply_swap,
    build_mesh,
    build_sp_mesh,
    load_from_rank0,
    needs_fsdp,
)
from mindspeed_mm.trainer.loss import reduce_loss, token_losses
from mindspeed_mm.trainer.sequence_parallel import SequenceParallel
from mindspeed_mm.trainer.task import TASKS
from mindspeed_mm.trainer.vision_balance import VisionBalance
from mindspeed_mm.trainer.vision_sync import VisionSync

logger = get_logger(__name__)


#: input kind (:attr:`VisionSync.paths`) -> the microbatch's key of its encoder input
MEDIA = {"image": "pixel_values", "video": "pixel_values_videos", "audio": "input_features"}


def build_model(config: MMConfig, world: int) -> tuple[Any, torch.nn.Module]:
    """The family and its model, frozen, recomputed and sharded as the recipe says.

    With several ranks only rank 0 reads the weights (on the host); every rank builds the model
    on the meta device, shards it, and receives its shards from rank 0 (the buffers, such as
    rotary frequencies that are in no checkpoint, too), so no other rank holds a full copy.
    With LoRA, peft's layers go in before sharding (on rank 0's loaded copy too, so the initial
    factors are rank 0's) and everything but the factors is frozen. One rank in fp32 trains the
    model as loaded, without FSDP2 (:func:`~mindspeed_mm.trainer.fsdp.needs_fsdp`).
    """
    m, p = config.model, config.parallel
    family = family_of(m.path)
    device = get_accelerator().device()
    weights, buffers = None, None
    lora = config.lora
    if world == 1:
        model = load_model(m.path, family, m.attn_implementation).to(device)
    else:
        if dist.get_rank() == 0:
            loaded = load_model(m.path, family, m.attn_implementation)
            if lora.enabled:  # the factors' initial values come from rank 0 like the weights
                apply_lora(loaded, lora, family)
            weights, buffers = loaded.state_dict(), dict(loaded.named_buffers())
            del loaded
        model = build_meta_model(m.path, family, m.attn_implementation)
    if lora.enabled:
        apply_lora(model, lora, family)
    freeze_parts(model, family, m.freeze)
    recomputed = apply_recompute(model, config.train.recompute_modules)
    apply_swap(model, config.train.swap_modules, recomputed)
    if needs_fsdp(world, config.train.precision):
        apply_fsdp(
            model,
            p.fsdp_plan if p.fsdp_plan is not None else family.fsdp_plan,
            build_mesh(world, p.dp_replicate, p.ulysses_parallel_size),
            config.train.precision,
            p.reshard_after_forward,
        )
    if world > 1:
        load_from_rank0(model, weights, buffers, device)
    model.train()
    return family, model


@dataclass
class HeldOutBatch:
    """One validation microbatch of a rank; ``counted=False``: a stand-in that only keeps the ranks' collectives
    in step (a rank left without a microbatch in the last round forwards the first one again)."""

    batch: PackedBatch
    counted: bool


class VLMTask:
    """Vision-language fine-tuning (:class:`~mindspeed_mm.trainer.task.TrainTask`, with a validation loss:
    :class:`~mindspeed_mm.trainer.task.ValidatedTask`).

    Samples are checked when the task is built and encoded on first use (``data.workers = 0``, no
    ``data.cache_dir``) or all before the first step (:mod:`mindspeed_mm.data.preprocess`: in
    parallel, cached); each microbatch packs ``train.micro_batch_size`` samples into one row. Counts: predicted tokens, samples with
    predicted tokens, tokens, microbatches.

    With ``parallel.ulysses_parallel_size = U`` the ``U`` consecutive ranks of a group get the
    same microbatches (data-parallel rank ``rank // U``) and each computes the loss of its
    shard of the row (:mod:`mindspeed_mm.trainer.sequence_parallel`); the counts are of the
    shard (samples counted on the group's first rank), so their sum over ranks is the step's.
    """

    def __init__(self, config: MMConfig, world: int) -> None:
        d, t = config.data, config.train
        self.config, self.world = config, world
        self.sp = config.parallel.ulysses_parallel_size
        self.source = Path(config.model.path)
        self.family, self.model = build_model(config, world)
        self.device = get_accelerator().device()
        self.keeps_logits = "logits_to_keep" in inspect.signature(type(self.model).forward).parameters
        self.vision_sync = VisionSync(self.model, self.family) if world > 1 else None
        group = build_sp_mesh(world, self.sp)["sp"].get_group() if self.sp > 1 else None
        if group is not None:
            _check_heads(self.model.config, self.sp)
        self.sequence = SequenceParallel(self.model, self.family, group)
        self.vision_balance = (
            VisionBalance(self.model, self.family, group) if group is not None and self.family.vision_module else None
        )
        # Unreadable media are found now, not at the step that reads them: one line, or skipped and counted.
        self.samples, self.skipped = check_mllm_media(read_mllm_files(d.files, d.image_dir, d.max_samples), d.skip_bad)
        self.valid_samples, skipped = (
            check_mllm_media(read_mllm_files(d.valid_files, d.image_dir), d.skip_bad, "data.valid_files")
            if d.valid_files
            else ([], 0)
        )
        self.skipped += skipped
        tokenizer, processor = load_processing(config.model.path, d.image_min_pixels, d.image_max_pixels)
        videos = any(sample.videos for sample in self.samples + self.valid_samples)
        audios = any(sample.audios for sample in self.samples + self.valid_samples)
        self.processing = Processing(
            tokenizer,
            processor,
            self.family,
            load_video_processor(config.model.path) if videos else None,
            load_audio_processor(config.model.path) if audios else None,
        )
        self.settings = EncodeSettings(
            d.cutoff_len,
            d.train_on_prompt,
            d.mask_history,
            VideoSettings(d.video_fps, d.video_maxlen, d.video_max_pixels, d.video_min_pixels),
        )
        if self.vision_sync is not None:
            self.vision_sync.videos = videos
            self.vision_sync.audio = audios
        self.order = SampleOrder(
            len(self.samples), t.micro_batch_size, t.gradient_accumulation_steps, world // self.sp, t.seed, d.shuffle
        )
        self._encoded: dict[int, EncodedSample] = {}
        self._valid_encoded: dict[int, EncodedSample] = {}
        self.preprocessing: dict[str, Any] = {}
        if d.workers > 0 or d.cache_dir:
            self._preprocess(world)
        if config.lora.enabled and config.checkpoint.save and dist.get_rank() == 0:
            # DCP checkpoints record the factors' rank in their shapes, not alpha: convert reads it here.
            write_adapter_config(config.lora, self.family, self.source, config.checkpoint.save)

    def _preprocess(self, world: int) -> None:
        """Encode every sample now (``data.workers`` processes; ``data.cache_dir``): with a cache, rank 0
        first, then the other ranks read its entry."""
        d = self.config.data

        def run() -> None:
            encoded, self.preprocessing = preprocess(
                self.samples,
                self.processing,
                self.settings,
                d.workers,
                d.cache_dir,
                d.files,
                self.config.model.path,
                {
                    "image_pixels": [d.image_min_pixels, d.image_max_pixels],
                    "image_dir": d.image_dir,
                    "max_samples": d.max_samples,
                },
            )
            self._encoded = dict(enumerate(encoded))

        first = world == 1 or not d.cache_dir or dist.get_rank() == 0
        if first:
            run()
        if world > 1 and d.cache_dir:
            dist.barrier()
            if not first:
                run()

    def _sample(self, index: int) -> EncodedSample | None:
        if index not in self._encoded:
            try:
                self._encoded[index] = self.processing.encode(self.samples[index], self.settings)
            except ValueError as error:  # a medium that passed the checks at start but cannot be decoded
                if not self.config.data.skip_bad:
                    raise ValueError(f"{error}, or set data.skip_bad=true") from None
                self.skipped += 1
                logger.warning("data.skip_bad: skipping %s (%d skipped so far)", error, self.skipped)
                self._encoded[index] = None
        return self._encoded[index]

    def microbatches(self, step: int, rank: int) -> list[PackedBatch]:
        """This rank's packed microbatches of ``step`` (samples skipped by ``data.skip_bad`` left out)."""
        dp_rank = rank // self.sp
        out = []
        for j in range(self.config.train.gradient_accumulation_steps):
            indices = self.order.indices(step, dp_rank, j)
            samples = [s for s in (self._sample(i) for i in indices) if s is not None]
            if not samples:
                raise ValueError(
                    f"data.skip_bad: every sample of a microbatch of step {step} was skipped "
                    f"({', '.join(self.samples[i].source for i in indices)}); fix or remove them"
                )
            out.append(pack_samples(samples, self.model, self.family))
        return out

    def counts(self, microbatches: list[PackedBatch]) -> torch.Tensor:
        """[predicted tokens, samples with predicted tokens, tokens, microbatches, microbatches with images,
        with videos, with audio] of this rank's shards (samples and microbatches counted on the
        sequence-parallel group's first rank; the last three on every rank: only whether they are 0 is read)."""
        counts = torch.zeros(4 + len(MEDIA), dtype=torch.float64)
        first = self.sequence.rank == 0
        for batch in microbatches:
            mask = batch.targets != IGNORE_INDEX
            per_sample = torch.zeros(batch.num_samples).index_add(0, batch.sample_index, mask.float())
            start, end = self.sequence.begin(batch.sample_index)
            samples = float((per_sample > 0).sum()) if first else 0.0
            media = [float(key in batch.vision) for key in MEDIA.values()]
            counts += torch.tensor(
                [float(mask[start:end].sum()), samples, float(end - start), float(first), *media], dtype=torch.float64
            )
        return counts.to(self.device)

    def finish_gradients(self, totals: torch.Tensor) -> None:
        """Drop the gradients of zeros that only the dummy encoder calls gave (:class:`VisionSync`).

        ``totals`` (:meth:`counts` summed over ranks) says which inputs a rank had: an encoder
        (:attr:`~mindspeed_mm.models.family.VLMFamily.encoders`) no rank's input ran keeps no gradient,
        so AdamW skips it (its momentum and weight decay included), as on one rank.
        """
        if self.vision_sync is None or not self.family.encoders:
            return
        used = {kind for i, kind in enumerate(MEDIA) if totals[4 + i] > 0}

        def under(name: str, kinds: Iterable[str]) -> bool:
            prefixes = [p for kind in kinds for p in self.family.encoders.get(kind, ())]
            return any(name == p or name.startswith(p + ".") for p in prefixes)

        unused = [kind for kind in self.family.encoders if kind not in used]
        for name, param in self.model.named_parameters():
            if param.grad is not None and under(name, unused) and not under(name, used):
                param.grad = None

    def loss(self, batch: PackedBatch, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of the microbatch (of this rank's shard of it) under ``train.loss_type``."""
        t = self.config.train
        return self._reduce(batch, totals, t.gradient_accumulation_steps, self.world)

    def valid_microbatches(self, rank: int) -> list[HeldOutBatch]:
        """This rank's microbatches of the validation set: ``data.valid_files`` in file order (the first
        ``eval.iters`` global batches), packed ``train.micro_batch_size`` to a microbatch, microbatch ``j`` on
        data-parallel rank ``j % dp``; every rank gets as many (stand-ins where the set runs out)."""
        t, dp = self.config.train, self.world // self.sp
        n = len(self.valid_samples)
        if self.config.eval.iters is not None:
            n = min(n, self.config.eval.iters * self.config.samples_per_step(self.world))
        chunks = [range(i, min(i + t.micro_batch_size, n)) for i in range(0, n, t.micro_batch_size)]
        rounds = -(-len(chunks) // dp)
        held = []
        for j in range(rank // self.sp, rounds * dp, dp):
            counted = j < len(chunks)
            samples = [self._valid_sample(i) for i in chunks[j if counted else 0]]
            held.append(HeldOutBatch(pack_samples(samples, self.model, self.family), counted))
        return held

    def valid_counts(self, microbatches: list[HeldOutBatch]) -> torch.Tensor:
        """:meth:`counts` of the counted validation microbatches."""
        return self.counts([held.batch for held in microbatches if held.counted])

    def valid_loss(self, held: HeldOutBatch, totals: torch.Tensor) -> torch.Tensor:
        """This rank's share of the validation loss (``totals``: :meth:`valid_counts` summed over ranks).

        The validation set is reduced as one global batch under ``train.loss_type``: its microbatches
        stand for the accumulated ones (``default``: the mean of their token means) and the ranks of a
        sequence-parallel group add up the shares of their shards, so the sum of the shares over the
        microbatches and all ranks is the loss, whatever the data- and sequence-parallel sizes.
        """
        reported = self._reduce(held.batch, totals, max(int(totals[3]), 1), self.sp)[1]
        return reported if held.counted else torch.zeros_like(reported)

    def _valid_sample(self, index: int) -> EncodedSample:
        if index not in self._valid_encoded:
            self._valid_encoded[index] = self.processing.encode(self.valid_samples[index], self.settings)
        return self._valid_encoded[index]

    def _reduce(
        self, batch: PackedBatch, totals: torch.Tensor, accumulation: int, world: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~mindspeed_mm.trainer.loss.reduce_loss` of the microbatch's forward (this rank's shard)."""
        t = self.config.train
        if self.vision_sync is not None:
            self.vision_sync.begin(batch.vision)
        start, end = self.sequence.begin(batch.sample_index)
        if self.vision_balance is not None:
            self.vision_balance.begin(batch.vision)
        mask = batch.targets != IGNORE_INDEX
        sample_tokens = torch.zeros(batch.num_samples).index_add(0, batch.sample_index, mask.float())
        # Only the positions that are predicted reach the head (transformers' ``logits_to_keep``):
        # the [tokens, vocab] logits of image and prompt tokens would be computed to be ignored.
        keep = mask[start:end].nonzero().squeeze(1)
        targets = batch.targets[start:end][keep].to(self.device)
        keep = keep.to(self.device)
        if self.keeps_logits:
            logits = self.model(**batch.model_inputs(self.device), logits_to_keep=keep).logits[0]
        else:  # a head without ``logits_to_keep`` (Qwen2.5-Omni's thinker): every position's logits, then the kept
            logits = self.model(**batch.model_inputs(self.device)).logits[0][keep]
        losses = token_losses(logits, targets)
        return reduce_loss(
            losses,
            targets,
            batch.sample_index[start:end].to(self.device)[keep],
            batch.num_samples,
            t.loss_type,
            accumulation,
            world,
            int(totals[0]),
            int(totals[1]),
            sp=self.sp,
            microbatch_tokens=int(mask.sum()),
            sample_tokens=sample_tokens,
        )

    def step_tokens(self, totals: torch.Tensor) -> int:
        """Tokens of the step over all ranks."""
        return int(totals[2])

    def export(self) -> dict[str, str]:
        """``checkpoint.save_hf`` (merged with LoRA) and ``lora.save_peft``."""
        ck, lora = self.config.checkpoint, self.config.lora
        if not ck.save_hf and not lora.save_peft:
            return {}
        state = full_state(self.model)
        written: dict[str, str] = {}
        if lora.save_peft and state is not None:
            written["save_peft"] = str(write_peft_adapter(state, lora, self.family, self.source, lora.save_peft))
        if ck.save_hf:
            dtype = target_dtype(ck.save_hf_dtype)
            if lora.enabled:  # the merged weights under the model's own names, written by a plain model
                plain = build_meta_model(self.source, self.family, self.config.model.attn_implementation)
                merged = merged_state(state, lora) if state is not None else None
                target = save_hf(
                    plain, self.source, ck.save_hf, state=merged if merged is not None else {}, dtype=dtype
                )
            else:
                target = save_hf(
                    self.model, self.source, ck.save_hf, state=state if state is not None else {}, dtype=dtype
                )
            if target is not None:
                written["save_hf"] = str(target)
        return written


def _check_heads(config: Any, sp: int) -> None:
    """Ulysses splits the language model's query heads over the group (kv heads are replicated where fewer)."""
    text = getattr(config, "text_config", config)
    heads = int(text.num_attention_heads)
    if heads % sp:
        raise ValueError(
            f"parallel.ulysses_parallel_size={sp} does not divide the language model's {heads} attention "
            "heads; use a divisor of the head count"
        )


TASKS.register("vlm", VLMTask)
