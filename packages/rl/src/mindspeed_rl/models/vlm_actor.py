"""The vision-language GRPO actor: a ``mindspeed_mm`` transformers VLM (Qwen2.5-VL, Qwen3-VL) with its
AdamW, scored and updated with the registered policy losses of :mod:`mindspeed_rl.algorithms`.

It serves the in-process GRPO step (:func:`mindspeed_rl.driver.trainer.train_on_batch`) as the megatron
:class:`~mindspeed_rl.models.actor.Actor` does: ``compute_logprobs(pairs)``, ``update(pairs, old_logp,
advantages, ref_logp, rollout_logp)``, ``version``, ``hf_state()``, ``close()``. A pair's prompt is a
:class:`~mindspeed_rl.rollout.vlm.VisionPrompt` (token ids with the image inputs attached).

A microbatch is ``micro_batch_size`` sequences ``prompt + response`` packed into one row as the
multimodal trainer packs samples (:func:`mindspeed_mm.data.packing.pack_samples`: each row's own M-RoPE
positions, attention kept inside each row by the suite's packed attention, images concatenated in row
order); the log-prob of response token ``t`` is read from the logits at the position before it, and only
those positions reach the head. With a Ulysses group (``group``) each rank runs its shard of the row
(:class:`~mindspeed_mm.trainer.sequence_parallel.SequenceParallel`, the trainer's hook) and the
gradients are summed over the group. The loss is the registered loss over the whole mini-batch
(``num_tokens`` / ``num_seqs`` of the mini-batch: microbatch losses add up to the mini-batch's).

With a data-parallel group (``dp_group``) every rank is given the whole mini-batch, runs its contiguous
share of the rows (:func:`dp_share`) and normalises by the whole mini-batch's counts; the gradients and
the metric sums are summed over every rank (data- and sequence-parallel), and ``compute_logprobs``
gathers the shares, so each rank returns the whole batch's log-probs. With ``fsdp`` the model is sharded
by the multimodal trainer's FSDP2 plan (:func:`mindspeed_mm.trainer.fsdp.apply_fsdp`, the family's
``fsdp_plan``) over all ranks; FSDP2 averages the gradients over them, so the loss is scaled by their
number before the backward (as ``mindspeed-mm train`` does), and :meth:`VisionActor.hf_state` gathers the
full weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed_mm.data.encode import IGNORE_INDEX, EncodedSample
from mindspeed_mm.data.packing import PackedBatch, pack_samples
from mindspeed_mm.models import family_of, load_model
from mindspeed_mm.models.family import VLMFamily
from mindspeed_mm.trainer.fsdp import apply_fsdp, build_mesh
from mindspeed_mm.trainer.optim import clip_gradients
from mindspeed_mm.trainer.sequence_parallel import SequenceParallel
from mindspeed_mm.trainer.vision_sync import VisionSync
from mindspeed_rl.algorithms.functional import logprobs_from_logits
from mindspeed_rl.algorithms.losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs, compute_policy_loss
from mindspeed_rl.rollout.vlm import VisionPrompt

Pair = tuple[VisionPrompt, list[int]]
#: Metrics the update reports (token-weighted means over the mini-batch, but SUMMED_METRICS).
VLM_UPDATE_METRICS = ("pg_clipfrac", "ppo_kl", "approx_kl", "kl_loss", "ratio_mean")
#: Of those, the ones that are (like the loss) the microbatch's share of the mini-batch's value: summed, not averaged.
SUMMED_METRICS = ("kl_loss",)


@dataclass(frozen=True)
class VisionActorSettings:
    """Optimizer, batching and loss of the vision-language actor (the recipe's ``actor`` / ``algorithm``)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    micro_batch_size: int = 8
    loss: str = "ppo_clip"
    loss_config: PolicyLossConfig | None = None
    seed: int = 1234


def dp_share(count: int, group: dist.ProcessGroup | None) -> slice:
    """This data-parallel rank's contiguous share of ``count`` rows (all of them without a group)."""
    if group is None:
        return slice(0, count)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return slice(count * rank // size, count * (rank + 1) // size)


def gather_rows(local: torch.Tensor, count: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[count, width]``: every rank's :func:`dp_share` rows (``local``) in rank order (a collective)."""
    if group is None:
        return local
    size = dist.get_world_size(group)
    rows = -(-count // size)
    # On the accelerator: NCCL / HCCL gather no host tensors.
    padded = torch.zeros(rows, local.shape[1], dtype=local.dtype, device=get_accelerator().device())
    padded[: len(local)] = local
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece[: len(range(count)[share])] for piece, share in zip(pieces, _shares(count, size))]).cpu()


def _shares(count: int, size: int) -> list[slice]:
    return [slice(count * r // size, count * (r + 1) // size) for r in range(size)]


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """``[rows, width]`` float32, each row's values first, zeros after."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def pack_pairs(pairs: Sequence[Pair], model: Any, family: VLMFamily) -> PackedBatch:
    """``prompt + response`` rows packed into one sequence as the multimodal trainer packs samples (the
    response tokens are the targets; each row's own M-RoPE positions; images concatenated in row order)."""
    samples = []
    for prompt, response in pairs:
        e, tail = prompt.encoded, torch.tensor(list(response), dtype=torch.long)
        samples.append(
            EncodedSample(
                input_ids=torch.cat([e.input_ids, tail]),
                labels=torch.cat([torch.full_like(e.input_ids, IGNORE_INDEX), tail]),
                mm_token_type_ids=torch.cat(
                    [e.mm_token_type_ids, torch.zeros(len(tail), dtype=e.mm_token_type_ids.dtype)]
                ),
                vision=e.vision,
                source=e.source,
            )
        )
    return pack_samples(samples, model, family)


def response_slots(pairs: Sequence[Pair]) -> torch.Tensor:
    """``[L, 2]`` for the packed row of ``pairs``: at a position predicting a response token, its (row, index)."""
    slots = torch.full((sum(len(p) + len(r) for p, r in pairs), 2), -1, dtype=torch.long)
    offset = 0
    for row, (prompt, response) in enumerate(pairs):
        first = offset + len(prompt) - 1  # the position whose logits predict the response's first token
        slots[first : first + len(response), 0] = row
        slots[first : first + len(response), 1] = torch.arange(len(response))
        offset += len(prompt) + len(response)
    return slots


class PackedForward:
    """Log-probs of ``prompt + response`` rows from one packed forward, split over a Ulysses group.

    The rows are packed into one sequence (attention kept inside each row by the multimodal suite's
    packed attention); with a group of ``U`` ranks each rank runs its contiguous ``1/U`` of the
    sequence (:class:`~mindspeed_mm.trainer.sequence_parallel.SequenceParallel`) and fills the
    response log-probs that fall in it. Only the positions that predict response tokens reach the head.
    """

    def __init__(
        self, model: Any, family: VLMFamily, group: dist.ProcessGroup | None = None, vision_sync: bool = False
    ) -> None:
        self.model, self.family, self.group = model, family, group
        self.sequence = SequenceParallel(model, family, group)
        # FSDP2: a microbatch without images still runs the vision tower (its collectives must match).
        self.vision_sync = VisionSync(model, family) if vision_sync else None
        self.saw_vision = False

    def __call__(self, pairs: Sequence[Pair], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp, here)``: ``[rows, width]`` log-probs of this rank's response tokens (zero elsewhere) and the
        ``[rows, width]`` mask of the tokens this rank computed (every response token on one rank)."""
        batch = pack_pairs(pairs, self.model, self.family)
        start, end = self.sequence.begin(batch.sample_index)
        slots = response_slots(pairs)[start:end]
        keep = (slots[:, 0] >= 0).nonzero().squeeze(1)
        targets = batch.targets[start:end][keep]
        device = get_accelerator().device()
        self.saw_vision = bool(batch.vision)  # whether the vision tower ran on real inputs
        if self.vision_sync is not None:
            self.vision_sync.begin(batch.vision)
        logits = self.model(**batch.model_inputs(device), logits_to_keep=keep.to(device)).logits[0]
        local = logprobs_from_logits(logits.float(), targets.to(device)).cpu()
        rows, cols = slots[keep, 0], slots[keep, 1]
        logp = torch.zeros(len(pairs), width).index_put((rows, cols), local)
        here = torch.zeros(len(pairs), width).index_put((rows, cols), torch.ones(len(keep)))
        return logp, here


class VisionActor:
    """The policy (trainable) or a frozen reference: the family's transformers model loaded by ``mindspeed_mm``.

    Args:
        model_dir: a Hugging Face directory of a registered ``mindspeed_mm`` family.
        settings: optimizer, batching and loss.
        trainable: False for a frozen reference (no optimizer).
        group: a Ulysses sequence-parallel group (None: one rank). Its ranks hold the same weights and get
            the same pairs; each runs its shard of every packed microbatch, and the gradients (and the
            log-probs) are summed over the group.
        dp_group: the data-parallel group (None: one replica). Its ranks get the same (whole) mini-batch
            and each runs its share of the rows. With both groups the actor's ranks are the whole world
            (the ``(dp, sp)`` mesh of :func:`mindspeed_mm.trainer.fsdp.build_sp_mesh`).
        fsdp: shard the (trainable) model with FSDP2 over all the actor's ranks (the family's ``fsdp_plan``).

    Raises:
        ValueError: with a group, a loss whose value is not a sum over tokens (``seq-mean-token-mean``,
            ``ratio_level: sequence``: a rank does not see a whole sequence), or a head count the group
            does not divide.
    """

    def __init__(
        self,
        model_dir: str | Path,
        settings: VisionActorSettings,
        trainable: bool = True,
        group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        fsdp: bool = False,
    ) -> None:
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.loss_config = settings.loss_config or POLICY_LOSSES.get(settings.loss).defaults
        family = family_of(model_dir)
        self.model = load_model(model_dir, family).to(get_accelerator().device())
        self.model.train(trainable)
        self.model.requires_grad_(trainable)
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.dp_group = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 else None
        if self.group is not None:
            check_sequence_parallel(self.model.config, self.loss_config, dist.get_world_size(self.group))
        #: The ranks the gradients and the metric sums add up over (data- and sequence-parallel).
        self.all_group = (
            self.dp_group if self.group is None else self.group if self.dp_group is None else dist.group.WORLD
        )
        self.fsdp = fsdp and trainable and self.all_group is not None
        if self.fsdp:
            world = dist.get_world_size(self.all_group)
            sp = dist.get_world_size(self.group) if self.group is not None else 1
            apply_fsdp(self.model, family.fsdp_plan, build_mesh(world, 1, sp), "fp32")
        self.forward = PackedForward(self.model, family, self.group, vision_sync=self.fsdp)
        self.optimizer = (
            torch.optim.AdamW(
                self.model.parameters(),
                lr=settings.lr,
                betas=(settings.adam_beta1, settings.adam_beta2),
                weight_decay=settings.weight_decay,
            )
            if trainable
            else None
        )
        self.version = 0
        self.streak = 0
        self.lora = None  # the LoRA actor's reference is not offered here

    def _micro(self, pairs: Sequence[Pair]) -> list[slice]:
        size = self.settings.micro_batch_size
        return [slice(i, min(i + size, len(pairs))) for i in range(0, len(pairs), size)]  # bounded: offsets add

    def _sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """``tensor`` summed over ``group`` (itself without one; reduced on the accelerator, as NCCL / HCCL need)."""
        if group is not None:
            moved = tensor.to(get_accelerator().device())
            dist.all_reduce(moved, group=group)
            tensor.copy_(moved)
        return tensor

    def _share(self, count: int) -> slice:
        """This rank's rows of a (mini-)batch of ``count``; FSDP2 needs equal shares (the same forwards everywhere)."""
        if self.fsdp and self.dp_group is not None and count % dist.get_world_size(self.dp_group):
            raise ValueError(f"{count} rows do not split evenly over the data-parallel ranks of an FSDP2 actor")
        return dp_share(count, self.dp_group)

    def compute_logprobs(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """Per row, the log-probs of its response tokens (no gradient; each data-parallel rank computes its
        share, and every rank returns all of them)."""
        share = self._share(len(pairs))
        mine = pairs[share]
        width = max(len(r) for _, r in pairs)
        local = torch.zeros(len(mine), width)
        with torch.no_grad():
            for part in self._micro(mine):
                logp, _ = self.forward(mine[part], width)
                local[part] = self._sum(logp.contiguous(), self.group)
        logp = gather_rows(local, len(pairs), self.dp_group)
        return [logp[i, : len(r)].clone() for i, (_, r) in enumerate(pairs)]

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names (for the rollout engine; gathered whole under FSDP2, a collective)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {name: value.detach() for name, value in self.model.state_dict().items()}

    def update(
        self,
        pairs: Sequence[Pair],
        old_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None,
        rollout_logp: torch.Tensor | None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch; its metrics (``loss``, ``grad_norm``, ``pg_clipfrac``, ...).

        A non-finite loss or gradient norm skips the step (``skipped`` 1, ``nonfinite_streak`` counts them).
        """
        if self.optimizer is None:
            raise ValueError("a frozen reference actor has no update; build it with trainable=True")
        width = max(len(r) for _, r in pairs)
        for given in (old_logp, ref_logp, rollout_logp, loss_mask):
            width = max(width, given.shape[-1]) if given is not None else width
        mask = pad_rows([torch.ones(len(r)) for _, r in pairs], width)
        if loss_mask is not None:
            mask = mask * loss_mask
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand(-1, width)
        num_tokens, num_seqs = float(mask.sum()), float(len(pairs))  # the whole mini-batch's, on every rank
        share = self._share(len(pairs))
        # FSDP2 averages the gradients over its ranks: the loss is scaled by their number, so they add up.
        scale = float(dist.get_world_size(self.all_group)) if self.fsdp else 1.0
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2 + len(VLM_UPDATE_METRICS), dtype=torch.float64)  # loss, tokens, metric sums
        seen: set[str] = set()  # the metrics the loss reports (kl_loss only with a reference)
        vision = False
        for micro in self._micro(pairs[share]):
            part = slice(share.start + micro.start, share.start + micro.stop)
            logp, here = self.forward(pairs[part], width)
            vision |= self.forward.saw_vision
            local = mask[part] * here  # the response tokens this rank computed
            inputs = PolicyLossInputs(
                logp=logp,
                old_logp=(old_logp[part] if old_logp is not None else logp.detach()).float(),
                advantages=adv[part].float(),
                mask=local,
                ref_logp=None if ref_logp is None else ref_logp[part].float(),
                rollout_logp=None if rollout_logp is None else rollout_logp[part].float(),
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            out = compute_policy_loss(self.settings.loss, inputs, self.loss_config)
            (out.loss * scale).backward()
            tokens = float(local.sum())
            sums[0] += float(out.loss.detach())
            sums[1] += tokens
            seen.update(out.metrics)
            for i, name in enumerate(VLM_UPDATE_METRICS):
                if name in out.metrics:
                    value = float(out.metrics[name])
                    sums[2 + i] += value if name in SUMMED_METRICS else value * tokens
        if self.all_group is not None:
            self._reduce_gradients(vision)
        return self._step(self._sum(sums, self.all_group), pairs, seen)

    def _reduce_gradients(self, vision: bool) -> None:
        """Sum the ranks' gradients (each is that of its tokens), so each rank holds the mini-batch's.

        A parameter keeps no gradient (AdamW skips it, momentum included) exactly when one rank running
        the whole mini-batch would leave it without one: when no rank's share used it (the vision tower
        on a mini-batch without images). Without FSDP2 the ranks agree on which parameters have
        gradients (a rank whose share did not use one adds zeros); under FSDP2 every parameter gets a
        gradient (the vision tower runs on a dummy image, :class:`~mindspeed_mm.trainer.vision_sync.VisionSync`),
        so the vision tower's are dropped when no rank had an image.
        """
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.fsdp:
            flag = torch.tensor([float(vision)], device=get_accelerator().device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.all_group)
            prefix = self.forward.family.vision_module
            if not flag.item() and prefix:
                for name, param in params:
                    if name.startswith(prefix + "."):
                        param.grad = None
            return
        has = torch.tensor([float(p.grad is not None) for _, p in params], device=get_accelerator().device())
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.all_group)
        for (_, param), used in zip(params, has.tolist()):
            if used:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=self.all_group)

    def _step(self, sums: torch.Tensor, pairs: Sequence[Pair], seen: set[str]) -> dict[str, float]:
        # The norm of the whole gradient (of every shard under FSDP2), clipped as mindspeed-mm train clips.
        norm = clip_gradients([p for p in self.model.parameters() if p.requires_grad], self.settings.clip_grad)
        loss, tokens = float(sums[0]), max(float(sums[1]), 1.0)
        finite = math.isfinite(norm) and math.isfinite(loss)
        if finite:
            self.optimizer.step()
        self.streak = 0 if finite else self.streak + 1
        self.version += 1
        metrics = {"loss": loss}
        metrics.update(
            {
                name: float(sums[2 + i]) / (1.0 if name in SUMMED_METRICS else tokens)
                for i, name in enumerate(VLM_UPDATE_METRICS)
                if name in seen
            }
        )
        metrics.update(
            grad_norm=norm,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            skipped=0.0 if finite else 1.0,
            nonfinite_streak=float(self.streak),
            update_tokens=float(sum(len(p) + len(r) for p, r in pairs)),
        )
        return metrics

    def close(self) -> None:
        """Remove the packed-attention (and vision-sync) hooks from the model."""
        self.forward.sequence.remove()
        if self.forward.vision_sync is not None:
            self.forward.vision_sync.remove()


def check_sequence_parallel(model_config: Any, loss: PolicyLossConfig, size: int) -> None:
    """Raise ValueError when a Ulysses group of ``size`` cannot split this model or this loss."""
    heads = int(getattr(model_config, "text_config", model_config).num_attention_heads)
    if heads % size:
        raise ValueError(
            f"a sequence-parallel group of {size} does not divide the {heads} attention heads; use a divisor"
        )
    if loss.loss_agg_mode == "seq-mean-token-mean" or loss.ratio_level == "sequence":
        raise ValueError(
            f"loss_agg_mode={loss.loss_agg_mode!r} / ratio_level={loss.ratio_level!r} need whole sequences on a rank; "
            "use token-mean or seq-mean-token-sum with token ratios under sequence parallelism"
        )
