"""DualPipeV: DeepSeek's V-shaped pipeline schedule over megatron-core model chunks.

With ``P`` pipeline ranks the layers split into ``2P`` chunks. Rank ``r`` holds chunk ``r`` and
chunk ``2P-1-r``: the forward goes down the ranks on the first chunks, turns on rank ``P-1`` into
its second chunk without a message, and comes back up to rank 0, which holds the embedding (its
first chunk) and the loss (its second chunk)::

    rank 0   [chunk 0 | emb]  ------------------------------------------->  [chunk 2P-1 | loss]
    rank 1      [chunk 1]  --------------------------------------->  [chunk 2P-2]
    ...
    rank P-1       [chunk P-1]  -- turns on the rank, no message -->  [chunk P]

Each rank runs its two chunks' forwards (F0, F1) and backwards (B1, B0) in the order of
:func:`dualpipev_plan`: warm-up forwards, then pairs that run the forward of one microbatch with
the backward of another (an accelerator overlaps the pair's compute with the other pair's
messages; on the CPU a pair runs in order), then cool-down backwards. The order is deadlock-free
with non-blocking sends and receives waited where their data is needed (a test simulates every
rank's plan for many ``P`` and microbatch counts). A link carries two kinds of message each way
(chunk 0's activations and chunk 1's gradients downwards, say), and the receiver does not always
want them in the order the sender sends them; NCCL and HCCL match point-to-point messages by
order, not tag. So each kind travels on a process group of its own (:func:`message_groups`: four
copies of the pipeline group), in which both ends send and receive in microbatch order, and no
tags are used: gloo then matches by order as well, so the CPU tests run the accelerators' rule.

The chunk of a microbatch runs through megatron's own ``forward_step`` / ``backward_step`` (loss
division by tokens and microbatches, the optimizer's loss scale), gradients are reduced by
megatron's ``finalize_model_grads`` as its 1F1B schedule does, so the step's numbers are 1F1B's.

Chunk 1 of rank ``r`` is megatron's virtual stage 1 of pipeline rank ``P-1-r`` (VPP=2 numbering):
:class:`MirroredPipelineGroup` gives its layers the global numbers (and checkpoint offsets) of
that position, so DualPipeV checkpoints hold megatron's usual layer numbering.
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator

#: A step of a rank's plan: ``("F", chunk)``, ``("B", chunk)`` or ``("FB", forward chunk, backward chunk)``.
Op = tuple

#: The kinds of message between neighbouring ranks (each on its own group of :func:`message_groups`):
#: forward activations of chunk 0 / chunk 1, gradients of chunk 1 / chunk 0.
TAG_ACT0, TAG_ACT1, TAG_GRAD1, TAG_GRAD0 = 0, 1, 2, 3

_MESSAGE_GROUPS: dict[tuple[int, ...], list[Any]] = {}


def message_groups(pp: Any) -> list[Any]:
    """Four process groups with the ranks of the pipeline group ``pp``, one per kind of message.

    Built once per pipeline group, collectively: the first call enumerates every rank's pipeline
    group over the world (an all-gather) and every rank creates the same groups in the same order.
    """
    ranks = tuple(dist.get_process_group_ranks(pp))
    if ranks not in _MESSAGE_GROUPS:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ranks)
        every = sorted({tuple(g) for g in gathered})
        for _ in range(4):
            for members in every:
                group = dist.new_group(list(members))
                if members == ranks:
                    _MESSAGE_GROUPS.setdefault(ranks, []).append(group)
    return _MESSAGE_GROUPS[ranks]


def dualpipev_plan(rank: int, num_ranks: int, num_microbatches: int, forward_only: bool = False) -> list[Op]:
    """The order in which pipeline rank ``rank`` runs its two chunks' forwards and backwards.

    Phases (counts per rank, ``P = num_ranks``, ``M = num_microbatches``): ``2(P-r-1)`` warm-up
    F0; ``r+1`` times F0, F1; ``P-r-1`` times B1, F1; ``M-2P+r+1`` times the pairs (F0 with B1),
    (F1 with B0); ``P-r-1`` times B1, (F1 with B0); ``r+1`` times B1, B0; ``P-r-1`` times B0.
    Every chunk runs ``M`` forwards and ``M`` backwards, each in microbatch order. (DeepSeek's
    zero-bubble split of B into input and weight gradients is not made: a B computes both.)

    Raises:
        ValueError: fewer than ``2P`` microbatches or fewer than 2 ranks.
    """
    p, r, m = num_ranks, rank, num_microbatches
    if p < 2 or not 0 <= r < p:
        raise ValueError(f"dualpipev needs pipeline rank 0 <= {r} < pp and pp >= 2 (got pp={p})")
    if forward_only:
        return [("F", 0)] * m + [("F", 1)] * m
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 x pp = {2 * p}, got {m}; raise train.global_batch_size "
            "or lower train.micro_batch_size"
        )
    plan: list[Op] = [("F", 0)] * (2 * (p - r - 1))
    plan += [("F", 0), ("F", 1)] * (r + 1)
    plan += [("B", 1), ("F", 1)] * (p - r - 1)
    plan += [("FB", 0, 1), ("FB", 1, 0)] * (m - 2 * p + r + 1)
    plan += [("B", 1), ("FB", 1, 0)] * (p - r - 1)
    plan += [("B", 1), ("B", 0)] * (r + 1)
    plan += [("B", 0)] * (p - r - 1)
    return plan


def dualpipev_chunks(num_layers: int, num_ranks: int) -> list[list[range]]:
    """Per rank, the global layer numbers (0-based) of its two chunks."""
    if num_layers % (2 * num_ranks):
        raise ValueError(
            f"num_layers={num_layers} is not divisible by 2 x pp = {2 * num_ranks} (dualpipev's chunks); "
            "change model.num_layers or parallel.pp"
        )
    n = num_layers // (2 * num_ranks)
    return [
        [range(r * n, (r + 1) * n), range((2 * num_ranks - 1 - r) * n, (2 * num_ranks - r) * n)]
        for r in range(num_ranks)
    ]


class MirroredPipelineGroup:
    """A pipeline group whose ``rank()`` is mirrored (``size - 1 - rank``), for building chunk 1.

    megatron numbers a chunk's layers from ``pg_collection.pp.rank()`` and the virtual stage;
    DualPipeV's second chunk of rank ``r`` sits where megatron's VPP=2 layout puts virtual
    stage 1 of rank ``P-1-r``. Only ``rank()`` differs; everything else is the real group's.
    """

    def __init__(self, group: Any) -> None:
        self._group = group

    def rank(self) -> int:
        """The mirrored rank."""
        return self._group.size() - 1 - self._group.rank()

    def size(self) -> int:
        """The group's size."""
        return self._group.size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def mirrored_groups(groups: Any) -> Any:
    """A shallow copy of a ``ProcessGroupCollection`` whose ``pp`` is :class:`MirroredPipelineGroup`."""
    mirrored = copy.copy(groups)
    mirrored.pp = MirroredPipelineGroup(groups.pp)
    return mirrored


_SELF_GROUP: list[Any] = []


def local_embedding_groups(groups: Any, model_build: bool = True) -> Any:
    """A shallow copy of a ``ProcessGroupCollection`` whose embedding group holds this rank alone.

    The V puts the embedding (chunk 0) and the output layer (chunk 1) on pipeline rank 0, so a
    tied embedding is kept tied on that rank (:func:`sum_tied_embedding_grads`), not by megatron's
    all-reduce between the first and the last stage. The model takes ``embd=None`` (no all-reduce
    at build); ``finalize_model_grads`` reads ``None`` as "megatron's global group", so it gets a
    one-rank group (``model_build=False``), built by this rank alone.
    """
    local = copy.copy(groups)
    if model_build:
        local.embd = None
    else:
        if not _SELF_GROUP:
            _SELF_GROUP.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))
        local.embd = _SELF_GROUP[0]
    return local


def sum_tied_embedding_grads(model: list[Any]) -> None:
    """Rank 0 of a tied-embedding V: both copies get the sum of the two chunks' gradients.

    What megatron's ``_allreduce_word_embedding_grads`` does between the first and last stage,
    done locally between chunk 0's embedding and chunk 1's output layer (before the data-parallel
    reduction, which is linear). A no-op without tied embeddings or off rank 0.
    """
    from megatron.core.utils import get_attr_wrapped_model

    chunks = [get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True) for chunk in model]
    if not (chunks[0].pre_process and chunks[1].post_process and chunks[1].share_embeddings_and_output_weights):
        return
    weights = [chunk.shared_embedding_or_output_weight() for chunk in chunks]
    attr = "main_grad" if hasattr(weights[0], "main_grad") else "grad"
    grads = [getattr(weight, attr) for weight in weights]
    if any(grad is None for grad in grads):  # a frozen embedding
        return
    total = grads[0] + grads[1]
    for grad in grads:
        grad.copy_(total)


class _Links:
    """The P2P messages of one rank with its pipeline neighbours (non-blocking, one group per kind)."""

    def __init__(self, group: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        self.rank, self.size = group.rank(), group.size()
        self.kinds = message_groups(group)
        self.sends: list[Any] = []

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, self.rank + offset)

    def send(self, tensor: torch.Tensor, offset: int, kind: int) -> None:
        data = tensor.detach().contiguous()
        self.sends.append((dist.isend(data, self._peer(offset), group=self.kinds[kind]), data))

    def recv(self, offset: int, kind: int, requires_grad: bool) -> torch.Tensor:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buffer, self._peer(offset), group=self.kinds[kind]).wait()
        return buffer.requires_grad_(requires_grad)

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def _no_sync(config: Any) -> contextlib.AbstractContextManager:
    funcs = config.no_sync_func
    if funcs is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for func in funcs if isinstance(funcs, list) else [funcs]:
        stack.enter_context(func())
    return stack


def forward_backward_dualpipev(
    *,
    forward_step_func: Callable,
    data_iterator: list[Iterator],
    model: list[Any],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    pg_collection: Any,
) -> list[Any]:
    """One step of DualPipeV over this rank's two chunks (the signature of megatron's schedules).

    Args:
        forward_step_func: megatron's ``(data_iterator, model) -> (output, loss_func)``.
        data_iterator: one iterator per chunk over the same microbatches.
        model: the two chunks (chunk 0 = layers of stage ``r``, chunk 1 = of stage ``2P-1-r``).
        num_microbatches: microbatches of the step (at least ``2P`` with a backward).
        seq_length: the sequence length (the activations' first dimension, before sequence parallelism).
        micro_batch_size: sequences per microbatch.
        forward_only: evaluation (no backward, no gradient reduction).
        pg_collection: megatron's process groups (``pp`` carries the messages).

    Returns:
        The loss function's outputs per microbatch on pipeline rank 0 (which computes the loss),
        nothing elsewhere, as megatron's schedules return them.
    """
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.utils import get_model_config, get_model_type

    if len(model) != 2 or len(data_iterator) != 2:
        raise ValueError(f"dualpipev runs two model chunks per rank, got {len(model)}")
    config = get_model_config(model[0])
    pp = pg_collection.pp
    rank, size = pp.rank(), pp.size()
    tp = pg_collection.tp.size()
    seq = seq_length // tp if config.sequence_parallel else seq_length
    device = get_accelerator().device()
    links = _Links(pp, (seq, micro_batch_size, config.hidden_size), config.pipeline_dtype, device)
    plan = dualpipev_plan(rank, size, num_microbatches, forward_only)
    last = size - 1
    store: list[Any] = []
    saved: list[deque] = [deque(), deque()]  # per chunk: (input, output) awaiting their backward
    turn_act: deque = deque()  # rank P-1: chunk 0's output, chunk 1's input
    turn_grad: deque = deque()  # rank P-1: chunk 1's input gradient, chunk 0's output gradient
    count = [0, 0]
    total_tokens = torch.zeros([], dtype=torch.int, device=device)
    model_type = get_model_type(model[0])

    def run_forward(chunk: int) -> None:
        nonlocal total_tokens
        grad = not forward_only
        if chunk == 0:
            inp = None if rank == 0 else links.recv(-1, TAG_ACT0, grad)
        else:
            inp = turn_act.popleft() if rank == last else links.recv(+1, TAG_ACT1, grad)
        micro = count[chunk]
        count[chunk] += 1
        out, tokens = forward_step(
            forward_step_func,
            data_iterator[chunk],
            model[chunk],
            num_microbatches,
            inp,
            store,
            config,
            1,
            is_first_microbatch=micro == 0,
            current_microbatch=micro,
            is_last_stage=chunk == 1 and rank == 0,
        )
        total_tokens += tokens
        if chunk == 0:
            if rank == last:  # the turn of the V: a new leaf, as a message would make it
                turn_act.append(out.detach().requires_grad_(grad))
            else:
                links.send(out, +1, TAG_ACT0)
        elif rank > 0:
            links.send(out, -1, TAG_ACT1)
        if grad:
            saved[chunk].append((inp, out))

    def run_backward(chunk: int) -> None:
        inp, out = saved[chunk].popleft()
        if chunk == 1:
            out_grad = None if rank == 0 else links.recv(-1, TAG_GRAD1, False)
        else:
            out_grad = turn_grad.popleft() if rank == last else links.recv(+1, TAG_GRAD0, False)
        in_grad = backward_step(inp, out, out_grad, model_type, config)
        if chunk == 1:
            if rank == last:
                turn_grad.append(in_grad)
            else:
                links.send(in_grad, +1, TAG_GRAD1)
        elif rank > 0:
            links.send(in_grad, -1, TAG_GRAD0)

    # Gradients are reduced once, by finalize_model_grads, as megatron's schedules do without overlap.
    with contextlib.nullcontext() if forward_only else _no_sync(config):
        for op in plan:
            if op[0] == "F":
                run_forward(op[1])
            elif op[0] == "B":
                run_backward(op[1])
            else:  # a pair: an accelerator overlaps it; here it runs in order
                run_forward(op[1])
                run_backward(op[2])
    links.wait_sends()
    if not forward_only and config.finalize_model_grads_func is not None:
        sum_tied_embedding_grads(model)
        if config.calculate_per_token_loss:
            # The V's loss is on rank 0; finalize_model_grads broadcasts the token count from the
            # last pipeline rank, which counted none: give every rank rank 0's count.
            dist.all_reduce(total_tokens, group=pp)
        config.finalize_model_grads_func(
            model,
            total_tokens if config.calculate_per_token_loss else None,
            pg_collection=local_embedding_groups(pg_collection, model_build=False),
        )
    return store
