"""Analytic peak device memory of one rank for a :class:`~mindspeed.autosettings.Layout`.

Static memory (per parameter of the rank; ``S`` = the rank's optimizer shard, ``P / dp`` with
the distributed optimizer, else ``P``):

- fp32: weight 4 + gradient buffer 4 + Adam moments ``8 S`` (the master is the weight);
- bf16: weight 2 + fp32 gradient buffer 4 + fp32 master ``4 S`` + moments ``8 S``;
  ``reuse_fp32_param`` keeps the master as a 2-byte remainder (``2 S`` saved);
  ``swap_optimizer`` moves master and moments to the host (``1 / times`` of them come back
  during the step).

Activations are what autograd keeps from a layer's forward for its backward (Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", counted for our layer:
registry norms that save their fp32 input and normalised input, a fused QKV projection whose
output stays alive through the ``v`` view, rotary copies of ``q`` and ``k``, a flash-style
attention that keeps its output and log-sum-exp (or the ``s x s`` probabilities of a math
attention), SwiGLU, and the linears' inputs). ``T = b s / cp`` tokens of a microbatch on a rank;
tensors outside the tensor-parallel region are ``T / tp`` with sequence parallelism. A fully
recomputed layer keeps only its input; the output-discarding recomputes drop the activation's
or the norms' outputs; swap-attention moves the attention side's saved tensors to the host.

Pipeline: rank ``r`` of ``pp`` holds ``min(pp - r, m)`` microbatches in flight under 1F1B and
``min(m v, 2 (pp - r - 1) + (v - 1) pp + 1)`` model chunks under the interleaved schedule
(megatron's warm-up counts). The peak is the in-flight microbatches' activations plus the
backward of the newest one, which walks down the layers freeing them and brings a recomputed
or swapped layer's tensors back, plus the largest gradient being formed; or, at the optimizer
step, the static memory plus the step's temporaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mindspeed.autosettings.layout import Layout
from mindspeed.autosettings.spec import JobSpec

#: Saved tensors smaller than this stay on the device under swap_attention (its default ``min_bytes``).
SWAP_MIN_BYTES = 1 << 14


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of the most loaded rank.

    Attributes:
        weights: parameters.
        grads: gradient buffers.
        optimizer: masters and optimizer state on the device between steps.
        activations: the peak of the forward/backward above the static memory.
        step: the optimizer step's peak above the static memory.
        stage: the pipeline rank the numbers are of.
    """

    weights: int
    grads: int
    optimizer: int
    activations: int
    step: int
    stage: int = 0

    @property
    def static(self) -> int:
        """Memory held between steps."""
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """The predicted peak: static plus the larger of the forward/backward and the step."""
        return self.static + max(self.activations, self.step)


@dataclass(frozen=True)
class _Tensor:
    """A tensor a layer saves: its bytes, which submodule saves it, and how recompute treats it."""

    nbytes: int
    module: str  # "input_norm", "self_attention", "post_attention_norm" or "mlp"
    role: str = ""  # "act_out": the activation's output; "norm_out"/"norm_state": a norm's output/internals
    swap_back: int | None = None  # bytes a swapped copy brings back (a view of a larger storage: less)


def _layer_params(job: JobSpec, layout: Layout) -> tuple[int, int]:
    """Parameters of one layer on a rank: (dense or expert MLP part included, largest single tensor)."""
    s, tp = job.shape, layout.tp
    q, kv = s.num_attention_heads * s.kv_channels, s.num_query_groups * s.kv_channels
    h = s.hidden_size
    qkv, proj = h * (q + 2 * kv) // tp, q * h // tp
    mats = 3 if s.swiglu or s.geglu else 2  # gated MLPs: [gate; up] in fc1
    if s.num_experts:
        f = s.moe_ffn_hidden_size
        fc1 = (s.num_experts // layout.ep) * h * f * (mats - 1) // tp
        mlp = fc1 + (s.num_experts // layout.ep) * h * f // tp + h * s.num_experts
    else:
        fc1 = h * s.ffn_hidden_size * (mats - 1) // tp
        mlp = fc1 + h * s.ffn_hidden_size // tp
    norms = 2 * h + (2 * s.kv_channels if s.qk_layernorm else 0)
    return qkv + proj + mlp + norms, max(qkv, proj, fc1)


def stage_params(job: JobSpec, layout: Layout, stage: int) -> tuple[int, int]:
    """Parameters of pipeline rank ``stage`` and its largest single tensor."""
    layer, largest = _layer_params(job, layout)
    embedding = job.padded_vocab(layout.tp) * job.shape.hidden_size // layout.tp
    total = layer * job.shape.num_layers // layout.pp
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        total += embedding
    if last:
        total += job.shape.hidden_size  # final norm
        if not job.shape.tie_embeddings or not first:
            total += embedding  # the output layer (a tied copy on the last stage under pp)
    if first or last:
        largest = max(largest, embedding)
    return total, largest


def _activation_key(layout: Layout) -> Layout:
    """The fields of ``layout`` a layer's activations depend on (the cache key of the per-layer numbers)."""
    return Layout(
        tp=layout.tp,
        cp=layout.cp,
        micro_batch_size=layout.micro_batch_size,
        sequence_parallel=layout.sequence_parallel,
        recompute="selective" if layout.recompute == "selective" else "none",
        recompute_activation=layout.recompute_activation,
        recompute_norm=layout.recompute_norm,
        swap_attention=layout.swap_attention,
    )


@functools.lru_cache(maxsize=4096)
def _layer_tensors(job: JobSpec, layout: Layout) -> tuple[_Tensor, ...]:
    """What one layer saves for one microbatch on one rank (no recompute, no swap)."""
    s = job.shape
    tp, dt = layout.tp, job.dtype_bytes
    seq = job.seq_length // layout.cp
    tokens = layout.micro_batch_size * seq
    outer = tokens // tp if layout.sequence_parallel else tokens  # tokens outside the TP region
    h, d = s.hidden_size, s.kv_channels
    heads = s.num_attention_heads // tp
    q, kv = heads * d, max(1, s.num_query_groups // tp) * d
    out: list[_Tensor] = []
    for module in ("input_norm", "post_attention_norm"):
        # The registry norm computes in fp32: its (upcast) input, the normalised input, 1/rms.
        out += [
            _Tensor(outer * h * 4, module, "norm_state"),
            _Tensor(outer * h * 4, module, "norm_state"),
            _Tensor(outer * 4, module, "norm_state"),
        ]
        if dt != 4:
            out.append(_Tensor(h * 4, module, "norm_state"))  # the weight, upcast
        consumer = "self_attention" if module == "input_norm" else "mlp"
        out.append(_Tensor(outer * h * dt, consumer, "norm_out"))  # the next linear's input
    out += [
        _Tensor(4 * seq * d * dt, "self_attention"),  # rotary cos/sin of q and k
        _Tensor(tokens * (q + 2 * kv) * dt, "self_attention", swap_back=tokens * kv * dt),  # QKV output (v's)
        _Tensor(tokens * q * dt, "self_attention"),  # rotated q
        _Tensor(tokens * kv * dt, "self_attention"),  # rotated k
        _Tensor(tokens * q * dt, "self_attention"),  # attention output (the projection's input)
    ]
    if job.flash_attention:
        out.append(_Tensor(tokens * heads * 4, "self_attention", "core"))  # log-sum-exp
    else:
        out.append(_Tensor(layout.micro_batch_size * heads * seq * seq * dt * 2, "self_attention", "core"))
    if s.num_experts:
        f = s.moe_ffn_hidden_size // tp
        routed = tokens * s.moe_router_topk
        out += [
            _Tensor(tokens * s.num_experts * 4 * 2, "mlp"),  # router logits and probabilities
            _Tensor(routed * h * dt, "mlp"),  # permuted tokens (the experts' fc1 input)
            _Tensor(routed * f * (2 if s.swiglu or s.geglu else 1) * dt, "mlp"),
            _Tensor(routed * f * dt, "mlp", "act_out"),
        ]
    else:
        f = s.ffn_hidden_size // tp
        out += [
            _Tensor(tokens * f * (2 if s.swiglu else 1) * dt, "mlp"),  # fc1 output (the activation's input)
            _Tensor(tokens * f * dt, "mlp", "act_out"),  # the activation's output (fc2's input)
        ]
    return tuple(out)


@dataclass(frozen=True)
class _LayerCost:
    held: int  # on the device from the forward until this layer's backward
    back: int  # extra bytes brought back (recomputed or prefetched) while its backward runs


def layer_cost(job: JobSpec, layout: Layout, recomputed: bool) -> _LayerCost:
    """Bytes a layer holds for one microbatch, and what its backward brings back on top."""
    return _layer_cost(job, _activation_key(layout), recomputed)


@functools.lru_cache(maxsize=16384)
def _layer_cost(job: JobSpec, layout: Layout, recomputed: bool) -> _LayerCost:
    tensors = _layer_tensors(job, layout)
    full = sum(t.nbytes for t in tensors)
    if recomputed:  # megatron's full recompute: only the layer's input stays
        outer = layout.micro_batch_size * job.seq_length // layout.cp
        if layout.sequence_parallel:
            outer //= layout.tp
        kept = outer * job.shape.hidden_size * job.dtype_bytes
        return _LayerCost(kept, full)
    held, back = 0, 0
    for t in tensors:
        dropped = (
            (layout.recompute_activation and t.role == "act_out")
            or (layout.recompute_norm and t.role in ("norm_out", "norm_state"))
            or (layout.recompute == "selective" and t.role == "core")
        )
        # Swapped: what input_norm, self_attention and post_attention_norm save (not fc1's input).
        swapped = layout.swap_attention and t.module != "mlp" and t.nbytes >= SWAP_MIN_BYTES
        if swapped:  # while a layer's backward runs, the layer below it is prefetched
            back += t.nbytes if t.swap_back is None else t.swap_back
        elif dropped:
            back += t.nbytes
        else:
            held += t.nbytes
    if layout.recompute_norm:  # the norms' checkpoints keep their inputs (the residual stream)
        outer = layout.micro_batch_size * job.seq_length // layout.cp
        if layout.sequence_parallel:
            outer //= layout.tp
        held += 2 * outer * job.shape.hidden_size * job.dtype_bytes
    return _LayerCost(held, back)


def moved_bytes(job: JobSpec, layout: Layout) -> tuple[int, int]:
    """Per layer and microbatch: bytes the output-discarding recomputes rebuild, and bytes swap-attention copies out."""
    return _moved_bytes(job, _activation_key(layout))


@functools.lru_cache(maxsize=4096)
def _moved_bytes(job: JobSpec, layout: Layout) -> tuple[int, int]:
    recomputed = swapped = 0
    for t in _layer_tensors(job, layout):
        if layout.swap_attention and t.module != "mlp" and t.nbytes >= SWAP_MIN_BYTES:
            swapped += t.nbytes if t.swap_back is None else t.swap_back
        elif (layout.recompute_activation and t.role == "act_out") or (
            layout.recompute_norm and t.role in ("norm_out", "norm_state")
        ):
            recomputed += t.nbytes
    return recomputed, swapped


def _loss_tensors(job: JobSpec, layout: Layout) -> int:
    """What the final norm, the output layer and the loss keep for one microbatch."""
    h, tp, dt = job.shape.hidden_size, layout.tp, job.dtype_bytes
    tokens = layout.micro_batch_size * job.seq_length // layout.cp
    outer = tokens // tp if layout.sequence_parallel else tokens
    norm = outer * h * 8 + outer * 4 + (h * 4 if dt != 4 else 0)
    logits = tokens * job.padded_vocab(tp) // tp * 4  # fp32 softmax, reused for its gradient
    return norm + outer * h * dt + logits + tokens * 9  # + labels and loss mask


def _mlp_backward(job: JobSpec, layout: Layout) -> int:
    """Temporaries of the activation's backward: its output gradient, its input gradient and one
    fp32 product (the registry SwiGLU computes in fp32 and writes both halves into one buffer)."""
    s = job.shape
    f = (s.moe_ffn_hidden_size if s.num_experts else s.ffn_hidden_size) // layout.tp
    tokens = layout.micro_batch_size * job.seq_length // layout.cp
    if s.num_experts:
        tokens *= s.moe_router_topk
    if not s.swiglu:
        return tokens * f * (2 * job.dtype_bytes + 4)
    per_element = 16 if job.dtype_bytes == 4 else 18
    return tokens * f * per_element


def _in_flight(layout: Layout, stage: int, microbatches: int) -> int:
    """Microbatches (1F1B) or model chunks (interleaved) rank ``stage`` holds at once."""
    if layout.pp == 1:
        return 1
    if layout.vpp:
        warmup = 2 * (layout.pp - stage - 1) + (layout.vpp - 1) * layout.pp
        return min(microbatches * layout.vpp, warmup + 1)
    return min(layout.pp - stage, microbatches)


def _activation_peak(job: JobSpec, layout: Layout, stage: int, largest_param: int) -> int:
    """Forward/backward peak above static memory on pipeline rank ``stage``."""
    layers = job.shape.num_layers // (layout.pp * layout.chunks)  # per model chunk
    kept, plain = layer_cost(job, layout, True), layer_cost(job, layout, False)
    costs = [kept if layout.recompute == "full" and i < layout.recompute_layers else plain for i in range(layers)]
    chunk_held = sum(c.held for c in costs)
    last = stage == layout.pp - 1
    loss = _loss_tensors(job, layout) if last else 0
    microbatches = layout.num_microbatches(job.global_batch_size)
    units = _in_flight(layout, stage, microbatches)
    # One unit is a microbatch through all chunks (1F1B) or one chunk (interleaved).
    unit_held = chunk_held * (1 if layout.vpp else layout.chunks)
    # The newest unit's backward: the loss first, then the layers from the last one down.
    grad_bytes = largest_param * job.dtype_bytes
    tokens = layout.micro_batch_size * job.seq_length // layout.cp
    hidden_grad = tokens * job.shape.hidden_size * job.dtype_bytes * 2
    walk = unit_held + loss + grad_bytes + hidden_grad
    remaining = unit_held
    mlp = _mlp_backward(job, layout) + tokens * job.shape.hidden_size * job.dtype_bytes
    for index, cost in enumerate(reversed(costs)):
        # Measured: when the last layer's activation is recomputed, the loss's tensors are still alive.
        overlap = loss if index == 0 and layout.recompute_activation else 0
        walk = max(walk, remaining + cost.back + mlp + overlap)
        remaining -= cost.held
    return (units - 1) * unit_held + walk


def _static(job: JobSpec, layout: Layout, params: int) -> tuple[int, int, int]:
    shard = -(-params // layout.dp) if layout.distributed_optimizer else params
    if job.precision == "bf16":
        weights, grads = 2 * params, 4 * params
        state = (2 if layout.reuse_fp32_param else 4) * shard + 8 * shard
    else:
        weights, grads = 4 * params, 4 * params
        state = 8 * shard
    if layout.swap_optimizer:
        state = 0
    return weights, grads, state


def _step_peak(job: JobSpec, layout: Layout, params: int, largest: int) -> int:
    """The optimizer step's temporaries above static memory."""
    shard = -(-params // layout.dp) if layout.distributed_optimizer else params
    largest_shard = min(largest, shard)
    temporaries = 3 * 4 * largest_shard  # a few fp32 tensors of the largest parameter
    if layout.swap_optimizer:
        per_element = 12 if job.precision == "bf16" else 8
        temporaries += -(-shard * per_element // layout.swap_optimizer_times)
    return temporaries


def estimate_memory(job: JobSpec, layout: Layout) -> MemoryEstimate:
    """The predicted peak of the most loaded pipeline rank (first or last; the middle ones hold less)."""
    best: MemoryEstimate | None = None
    for stage in sorted({0, layout.pp - 1}):
        params, largest = stage_params(job, layout, stage)
        weights, grads, state = _static(job, layout, params)
        estimate = MemoryEstimate(
            weights=weights,
            grads=grads,
            optimizer=state,
            activations=_activation_peak(job, layout, stage, largest),
            step=_step_peak(job, layout, params, largest),
            stage=stage,
        )
        if best is None or estimate.peak > best.peak:
            best = estimate
    assert best is not None
    return best
