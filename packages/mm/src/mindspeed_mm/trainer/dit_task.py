"""The diffusion-transformer task: flow matching on cached latents and text embeddings (Wan, FLUX).

Each microbatch stacks ``train.micro_batch_size`` cached samples of one latent shape
(:class:`~mindspeed_mm.data.buckets.BucketOrder`), pads their
text embeddings with zeros to ``data.text_len`` (as the pipelines do), and draws its timesteps,
noise and text dropout from a generator seeded by the step and its place in the step
(:class:`~mindspeed_mm.diffusion.FlowMatching`). The loss is the weighted mean squared error of
the predicted velocity against ``noise - x0``: per sample over its elements, then the mean over
the microbatch, the microbatches and the ranks (every sample has as many elements, so this is
the mean over the global batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing.hf_dtype import target_dtype
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_mm.config import MMConfig
from mindspeed_mm.data.buckets import BucketOrder
from mindspeed_mm.data.features import FeatureSet
from mindspeed_mm.data.media_features import MediaFeatures
from mindspeed_mm.diffusion import FlowDraw, FlowMatching
from mindspeed_mm.models.dit import DiTFamily, build_meta_dit, dit_family_of, load_dit
from mindspeed_mm.models.dit_compile import compile_blocks
from mindspeed_mm.models.dit_parallel import SequenceParallel, apply_sequence_parallel
from mindspeed_mm.models.loading import freeze_parts
from mindspeed_mm.models.lora import apply_lora, merged_state, write_adapter_config
from mindspeed_mm.models.wan_experts import EXPERT_FOLDERS, load_pair, pair_plan, resolve_boundary_ratio
from mindspeed_mm.trainer.dit_export import save_diffusers, save_expert_pair, write_dit_lora
from mindspeed_mm.trainer.export import full_state as gather_state
from mindspeed_mm.trainer.fsdp import (
    apply_fsdp,
    apply_recompute,
    apply_swap,
    build_mesh,
    build_sp_mesh,
    load_from_rank0,
    needs_fsdp,
)
from mindspeed_mm.trainer.task import TASKS

logger = get_logger(__name__)


def build_dit(config: MMConfig, world: int) -> tuple[DiTFamily, torch.nn.Module]:
    """The family and its diffusers model, frozen, recomputed and sharded as the recipe says.

    With several ranks only rank 0 reads the weights; the others build the model on the meta
    device and receive their shards (and the buffers) from rank 0. With LoRA (``lora``), peft's
    layers go in before sharding (on rank 0's loaded copy too, so the initial factors are rank 0's)
    and everything but the factors is frozen, as for vision-language models. With ``train.compile``
    the repeated blocks' forwards are compiled (:func:`~mindspeed_mm.models.dit_compile.compile_blocks`).
    """
    m, p, lora = config.model, config.parallel, config.lora
    family = dit_family_of(m.path)
    device = get_accelerator().device()
    load, build_meta, plan = _loaders(config, family)
    full_state, buffers = None, None
    if world == 1:
        model = load().to(device)
    else:
        if dist.get_rank() == 0:
            loaded = load()
            if lora.enabled:
                _each_expert(loaded, apply_lora, lora, family)
            full_state, buffers = loaded.state_dict(), dict(loaded.named_buffers())
            del loaded
        model = build_meta()
    if lora.enabled:
        _each_expert(model, apply_lora, lora, family)
    if m.freeze:
        _each_expert(model, freeze_parts, family, m.freeze)
    compile_blocks(model, config.train.compile)  # before recompute and FSDP2: their wrappers stay eager
    recomputed = apply_recompute(model, config.train.recompute_modules)
    apply_swap(model, config.train.swap_modules, recomputed)
    if needs_fsdp(world, config.train.precision):  # one fp32 rank trains the model as loaded
        apply_fsdp(
            model,
            p.fsdp_plan if p.fsdp_plan is not None else plan,
            build_mesh(world, p.dp_replicate, p.sequence_parallel_size),
            config.train.precision,
            p.reshard_after_forward,
        )
    if world > 1:
        load_from_rank0(model, full_state, buffers, device)
    model.train()
    return family, model


def _each_expert(model: torch.nn.Module, apply: Callable[..., Any], *args: Any) -> None:
    """``apply(expert, *args)`` on each expert of a Wan2.2 pair (module names as in one transformer), else on ``model``."""
    for expert in getattr(model, "experts", None) or (model,):
        apply(expert, *args)


def _loaders(config: MMConfig, family: DiTFamily) -> tuple[Callable[[], Any], Callable[[], Any], tuple[str, ...]]:
    """``(load, build on meta, FSDP2 plan)``: of ``model.path``, or with ``diffusion.expert=both`` of both experts."""
    m, d = config.model, config.diffusion
    if d.expert != "both":
        return (lambda: load_dit(m.path, family)), (lambda: build_meta_dit(m.path, family)), family.fsdp_plan
    boundary = resolve_boundary_ratio(d.boundary_ratio, m.path, d.expert) * d.num_train_timesteps
    return (
        lambda: load_pair(m.path, family, boundary),
        lambda: load_pair(m.path, family, boundary, meta=True),
        pair_plan(family.fsdp_plan),
    )


@dataclass
class DiTBatch:
    """One microbatch of cached samples and its draws.

    Attributes:
        indices: the samples' indices in the feature cache.
        latents: clean latents ``x0`` ``[B, ...]``.
        text: text embeddings zero-padded to the text length ``[B, L, D]`` (before the dropout).
        pooled: pooled text embeddings ``[B, P]`` (models that take one), else None.
        draw: the timesteps' grid indices, the noise and the text dropout.
        tokens: tokens the transformer sees over the microbatch.
        conditions: the family's per-sample conditions ``[B, ...]`` by name (Wan I2V: ``image_latents``,
            ``image_embeds``), kept through the text dropout.
        null_text: each sample's own empty-prompt embedding ``[B, L, D]`` that the text dropout substitutes
            (Qwen-Image-Edit: the empty prompt encoded with the sample's source image), else None (the cache's one).
    """

    indices: list[int]
    latents: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor | None
    draw: FlowDraw
    tokens: int
    conditions: dict[str, torch.Tensor] = field(default_factory=dict)
    null_text: torch.Tensor | None = None


class DiTTask:
    """Flow-matching training of a diffusers transformer (:class:`~mindspeed_mm.trainer.task.TrainTask`).

    Counts: samples, tokens.

    With ``U = parallel.ulysses_parallel_size x parallel.ring_attention_size`` above 1 the ``U``
    consecutive ranks of a group get the same microbatches (data-parallel rank ``rank // U``, the same
    draws) and the model splits their tokens (:mod:`mindspeed_mm.models.dit_parallel`: Ulysses, ring
    or both, ``parallel.sequence_algo``); each rank's gradients are its tokens' share, which
    FSDP2's mean over all ranks divides by ``U`` too, so the backward loss is scaled by ``U``. Counts
    are taken on the group's first rank. From raw media, the group's ranks encode every ``U``-th
    sample of a microbatch each and exchange the features.
    """

    def __init__(self, config: MMConfig, world: int) -> None:
        d, t = config.data, config.train
        self.config, self.world = config, world
        self.source = Path(config.model.path)
        expert = config.diffusion.expert
        self.boundary_ratio = (
            resolve_boundary_ratio(config.diffusion.boundary_ratio, self.source, expert) if expert != "none" else None
        )
        self.family, self.model = build_dit(config, world)
        self.device = get_accelerator().device()
        p = config.parallel
        self.sp = p.sequence_parallel_size
        self.sequence: SequenceParallel | None = None
        if self.sp > 1:
            if self.family.sequence_plan is None:
                raise ValueError(
                    f"{self.family.architecture} has no sequence-parallel plan; set parallel.ulysses_parallel_size=1 "
                    "and parallel.ring_attention_size=1"
                )
            group = build_sp_mesh(world, self.sp)["sp"].get_group()
            self.sequence = apply_sequence_parallel(
                self.model, self.family.sequence_plan, group, p.sequence_algo, p.ulysses_parallel_size
            )
        # A feature cache, or the encoders run on the raw media of data.files as samples are read.
        self.features = FeatureSet(d.features) if d.features else MediaFeatures(config, self.family)
        self.flow = FlowMatching(config.diffusion)
        if expert in ("high_noise", "low_noise"):
            self.flow.index_range = self.flow.expert_range(expert, self.boundary_ratio)
        self.text_len = d.text_len or self.family.text_len
        self.order = BucketOrder(
            self.features.shapes(),
            t.micro_batch_size,
            t.gradient_accumulation_steps,
            world // self.sp,
            t.seed,
            d.shuffle,
        )
        self.null = self._null_text()
        self._fp32: dict[str, torch.Tensor] = {}
        # Runs after FSDP2's own pre-forward hook, which casts every float input to bf16.
        self.model.register_forward_pre_hook(self._restore_fp32_inputs, with_kwargs=True)
        if config.lora.enabled and config.checkpoint.save and dist.get_rank() == 0:
            # DCP checkpoints record the factors' rank in their shapes, not alpha: convert reads it here.
            write_adapter_config(config.lora, self.family, self.source, config.checkpoint.save)

    def _null_text(self) -> dict[str, torch.Tensor]:
        null = self.features.null()
        if null is None:
            if self.config.diffusion.text_dropout > 0:
                logger.warning(
                    "%s has no null.safetensors: text dropout uses zero text embeddings", self.features.directory
                )
            first = self.features[0]
            null = {
                key: torch.zeros_like(first[key][:0] if key == "text" else first[key])
                for key in ("text", "pooled")
                if key in first
            }
        if "text" in null:
            null["text"] = self._pad(null["text"], "null.safetensors")
        return null

    def _pad(self, text: torch.Tensor, name: str) -> torch.Tensor:
        if text.shape[0] > self.text_len:
            raise ValueError(
                f"{self.features.directory}: the text embedding of {name} has {text.shape[0]} tokens, "
                f"more than data.text_len={self.text_len}; raise data.text_len"
            )
        return torch.cat([text, text.new_zeros(self.text_len - text.shape[0], text.shape[1])])

    def _restore_fp32_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs.update(self._fp32)
        self._fp32 = {}
        return args, kwargs

    def _batch(self, indices: list[int], microbatch: int) -> DiTBatch:
        samples = self._read(indices)
        shape = tuple(samples[0]["latents"].shape)
        for i, sample in zip(indices, samples):
            if tuple(sample["latents"].shape) != shape:
                raise ValueError(
                    f"{self.features.directory}: sample {self.features.entries[i]['id']} has latents "
                    f"{tuple(sample['latents'].shape)} but its index line says another shape; "
                    "rewrite the cache"
                )
            if len(shape) != self.family.latent_dims:
                raise ValueError(
                    f"{self.features.directory}: latents of {len(shape)} dimensions; "
                    f"{self.family.architecture} takes {self.family.latent_dims}"
                )
        latents = torch.stack([s["latents"].float() for s in samples])
        text = torch.stack(
            [self._pad(s["text"].float(), self.features.entries[i]["id"]) for i, s in zip(indices, samples)]
        )
        pooled = None
        if self.family.needs_pooled:
            if any("pooled" not in s for s in samples):
                raise ValueError(
                    f"{self.features.directory}: {self.family.architecture} needs pooled text "
                    "embeddings (`ID.pooled`); extract features for this model"
                )
            pooled = torch.stack([s["pooled"].float() for s in samples])
        conditions = {}
        for key in self.family.condition_keys(self.model.config):
            if any(key not in s for s in samples):
                raise ValueError(
                    f"{self.features.directory}: {self.family.key} needs `ID.{key}` in every sample; extract "
                    "features for this model"
                )
            shapes = sorted({tuple(s[key].shape) for s in samples})
            if len(shapes) > 1:  # Qwen-Image-Edit: source images of different aspect ratios in one microbatch
                raise ValueError(
                    f"{self.features.directory}: `{key}` of shapes {shapes} in one microbatch; set "
                    "train.micro_batch_size=1 or give sources of one aspect ratio"
                )
            conditions[key] = torch.stack([s[key].float() for s in samples])
        null_text = None
        if self.family.image_prompts and self.config.diffusion.text_dropout > 0:
            # Qwen-Image-Edit's empty prompt is encoded with each sample's source image
            if any("null_text" not in s for s in samples):
                raise ValueError(
                    f"diffusion.text_dropout={self.config.diffusion.text_dropout}: {self.family.key} drops to the "
                    f"empty prompt encoded with each source image (`ID.null_text`), which {self.features.directory} "
                    "lacks; extract features with the same diffusion.text_dropout, or set diffusion.text_dropout=0"
                )
            null_text = torch.stack(
                [self._pad(s["null_text"].float(), self.features.entries[i]["id"]) for i, s in zip(indices, samples)]
            )
        draw = self.flow.draw(self.flow.generator(self.config.train.seed, microbatch), tuple(latents.shape))
        tokens = self.family.tokens(self.model.config, shape) * len(indices)
        return DiTBatch(indices, latents, text, pooled, draw, tokens, conditions, null_text)

    def _read(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples; from raw media under sequence parallelism each group rank encodes every ``U``-th one."""
        if self.sequence is None or not isinstance(self.features, MediaFeatures):
            return [self.features[i] for i in indices]
        group, rank = self.sequence.group, self.sequence.rank
        own = {
            p: {k: v.cpu() for k, v in self.features[i].items()} for p, i in enumerate(indices) if p % self.sp == rank
        }
        shares: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(self.sp)]
        dist.all_gather_object(shares, own, group=group)
        merged = {p: sample for share in shares for p, sample in share.items()}
        return [merged[p] for p in range(len(indices))]

    def microbatches(self, step: int, rank: int) -> list[DiTBatch]:
        """This rank's microbatches of ``step`` (those of its data-parallel rank)."""
        dp_rank = rank // self.sp
        return [
            self._batch(self.order.indices(step, dp_rank, j), self.order.number(step, dp_rank, j))
            for j in range(self.config.train.gradient_accumulation_steps)
        ]

    def counts(self, microbatches: list[DiTBatch]) -> torch.Tensor:
        """[samples, tokens] of this rank (of its group, on the group's first rank)."""
        first = self.sequence is None or self.sequence.rank == 0
        return torch.tensor(
            [float(sum(len(b.indices) for b in microbatches)), float(sum(b.tokens for b in microbatches))]
            if first
            else [0.0, 0.0],
            dtype=torch.float64,
            device=self.device,
        )

    def model_text(self, batch: DiTBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The text (and pooled) embeddings after the text dropout, on the device."""
        drop = batch.draw.drop.to(self.device)
        null = self.null["text"] if batch.null_text is None else batch.null_text
        text = torch.where(drop[:, None, None], null.to(self.device), batch.text.to(self.device))
        pooled = batch.pooled
        if pooled is not None:
            pooled = torch.where(drop[:, None], self.null["pooled"].to(self.device), pooled.to(self.device))
        return text, pooled

    def loss(self, batch: DiTBatch, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The microbatch's mean weighted flow-matching loss (scaled for accumulation) and its reported share."""
        accumulation = self.config.train.gradient_accumulation_steps
        latents, noise = batch.latents.to(self.device), batch.draw.noise.to(self.device)
        indices = batch.draw.indices
        noisy = self.flow.noisy(latents, noise, indices)
        sigmas = self.flow.sigmas[indices].to(self.device)
        text, pooled = self.model_text(batch)
        conditions = {key: value.to(self.device) for key, value in batch.conditions.items()}
        skip = None
        if self.family.first_frame_condition:  # Wan2.2 TI2V: the drawn samples get x0's first frame, clean
            skip = batch.draw.first_frame
            conditions.update(image_latents=latents[:, :, :1], first_frame=skip.to(self.device))
        inputs = self.family.model_inputs(
            self.model.config, noisy, sigmas, text, pooled, self.config.diffusion.guidance_scale, **conditions
        )
        self._fp32 = {name: inputs[name].float() for name in self.family.fp32_inputs if inputs.get(name) is not None}
        if self.sequence is not None:  # put back after the split hooks: split as they split the model's inputs
            self._fp32 = self.sequence.split_model_inputs(self._fp32)
        prediction = self.family.prediction(self.model(**inputs), tuple(latents.shape))
        loss = self.flow.loss(prediction, latents, noise, indices, skip).mean()
        # Every rank of a sequence-parallel group computes the whole loss and the gradient of its tokens.
        return loss * self.sp / accumulation, loss.detach() / (accumulation * self.world)

    def step_tokens(self, totals: torch.Tensor) -> int:
        """Tokens of the step over all ranks."""
        return int(totals[1])

    def export(self) -> dict[str, str]:
        """``checkpoint.save_hf`` (the trained transformer as a diffusers directory, LoRA merged) and
        ``lora.save_peft`` (the factors as a diffusers LoRA)."""
        ck, lora = self.config.checkpoint, self.config.lora
        if not ck.save_hf and not lora.save_peft:
            return {}
        state = gather_state(self.model)
        written: dict[str, str] = {}
        if lora.save_peft and state is not None:
            if self.config.diffusion.expert == "both":  # one diffusers LoRA per expert: SAVE/transformer{,_2}
                for folder in EXPERT_FOLDERS:
                    part = {k[len(folder) + 1 :]: v for k, v in state.items() if k.startswith(folder + ".")}
                    write_dit_lora(part, lora, self.family, Path(lora.save_peft) / folder)
                written["save_peft"] = lora.save_peft
            else:
                written["save_peft"] = str(write_dit_lora(state, lora, self.family, lora.save_peft))
        if ck.save_hf:
            if lora.enabled and state is not None:
                state = merged_state(state, lora)
            dtype = target_dtype(ck.save_hf_dtype)
            if self.config.diffusion.expert == "both":
                target = save_expert_pair(
                    self.model,
                    self.family,
                    self.source,
                    ck.save_hf,
                    self.boundary_ratio,
                    state=state or {},
                    dtype=dtype,
                )
            else:
                target = save_diffusers(
                    self.model, self.family, self.source, ck.save_hf, state=state or {}, dtype=dtype
                )
            if target is not None:
                written["save_hf"] = str(target)
        return written


TASKS.register("dit", DiTTask)
