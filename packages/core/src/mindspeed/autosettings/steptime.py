"""Analytic step time of one optimizer step for a :class:`~mindspeed.autosettings.Layout`.

Per microbatch on the slowest pipeline rank:

- compute: the model FLOPs of its layers (:mod:`mindspeed.metrics.flops`: three forwards for
  forward + backward) for ``b s / cp`` tokens, over ``tp``, at ``mfu x peak``; recompute adds a
  forward of every recomputed layer (full), of core attention (selective), or re-reads the
  activation's / norms' inputs at the device's memory bandwidth (output-discarding recompute);
- tensor parallelism: four all-reduces (or all-gather + reduce-scatter pairs) of ``b s h``
  elements per layer (six with full recompute), ring cost ``2 (tp - 1) / tp``;
- context parallelism: the ring passes ``K`` and ``V`` around ``cp - 1`` times in the forward
  and twice that in the backward; expert parallelism: two all-to-alls per direction per layer;
- pipeline: one activation and one gradient per microbatch and chunk cross each stage boundary;
- swap_attention: the swapped bytes go to the host and back; with asynchronous copies (a side
  stream) only what the layer's compute does not hide shows.

The step is ``m`` microbatches times that, stretched by the pipeline bubble ``(pp - 1) / (m v)``,
plus the data-parallel gradient reduction (reduce-scatter + all-gather with the distributed
optimizer), the optimizer's pass over its shard at memory bandwidth, and for swap_optimizer the
state's round trip to the host. Links inside a node run at ``link_gbps``; a group that spans
nodes at a quarter of it; every call costs ``latency_s`` on top.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mindspeed.autosettings.layout import Layout
from mindspeed.autosettings.memory import moved_bytes
from mindspeed.autosettings.spec import ClusterSpec, JobSpec
from mindspeed.metrics.flops import forward_flops_per_token


@dataclass(frozen=True)
class TimeEstimate:
    """Predicted seconds of one step, by part.

    Attributes:
        compute: model and recompute FLOPs of the busiest rank (bubble excluded).
        communication: tensor-, context-, expert- and pipeline-parallel traffic of the microbatches.
        bubble: idle time of the pipeline's fill and drain.
        data_parallel: the gradient reduction (and parameter all-gather) after the backward.
        optimizer: the optimizer step, swaps of its state included.
        swap: exposed activation-swap copies.
    """

    compute: float
    communication: float
    bubble: float
    data_parallel: float
    optimizer: float
    swap: float

    @property
    def total(self) -> float:
        """Seconds per step."""
        return self.compute + self.communication + self.bubble + self.data_parallel + self.optimizer + self.swap


def _bandwidth(cluster: ClusterSpec, group_span: int) -> float:
    """Bytes/s of a group whose ranks lie ``group_span`` consecutive devices apart at most."""
    gbps = cluster.link_gbps if group_span <= cluster.nproc_per_node else cluster.link_gbps / 4
    return gbps * 1e9


def _ring(bytes_: float, size: int, bandwidth: float) -> float:
    return 0.0 if size == 1 else 2 * (size - 1) / size * bytes_ / bandwidth


@functools.lru_cache(maxsize=64)
def _layer_flops(job: JobSpec) -> float:
    """Forward FLOPs of one token through one (average) layer."""
    s = job.shape
    return (forward_flops_per_token(s, job.seq_length) - 2.0 * s.hidden_size * s.vocab_size) / s.num_layers


def estimate_step_time(job: JobSpec, layout: Layout, cluster: ClusterSpec, params_per_rank: int) -> TimeEstimate:
    """The predicted step time of ``layout`` (see the module docstring).

    Args:
        job: the model and batch.
        layout: the candidate.
        cluster: the devices and links.
        params_per_rank: parameters of the busiest pipeline rank (for the data-parallel and optimizer terms).
    """
    s = job.shape
    dt = job.dtype_bytes
    flops_rate = cluster.peak_tflops * 1e12 * cluster.mfu
    memory_rate = cluster.memory_gbps * 1e9
    seq = job.seq_length // layout.cp
    tokens = layout.micro_batch_size * seq  # per rank per microbatch, before tp
    layers = s.num_layers // layout.pp
    # Model FLOPs of one token through one layer (the output layer counted on the last stage).
    head = 2.0 * s.hidden_size * job.padded_vocab(layout.tp)
    layer_flops = _layer_flops(job)
    forward = tokens * (layers * layer_flops + head) / layout.tp
    compute = 3 * forward
    q = s.num_attention_heads * s.kv_channels
    if layout.recompute == "full":
        compute += tokens * layout.recompute_layers * layout.chunks * layer_flops / layout.tp
    elif layout.recompute == "selective":
        compute += tokens * layers * 4.0 * job.seq_length * q / layout.tp
    rebuilt, swapped = moved_bytes(job, layout)
    discarding = layers - (layout.recompute_layers * layout.chunks if layout.recompute == "full" else 0)
    compute_s = compute / flops_rate + 2 * rebuilt * discarding / memory_rate  # read the input, write the output
    # Traffic per microbatch.
    activation = tokens * s.hidden_size * dt
    tp_calls = 4 + (2 if layout.recompute == "full" else 0)
    lat = cluster.latency_s
    comm = 0.0
    if layout.tp > 1:
        comm += layers * tp_calls * (_ring(activation, layout.tp, _bandwidth(cluster, layout.tp)) + lat)
    if layout.cp > 1:
        kv = tokens * 2 * s.num_query_groups * s.kv_channels * dt / layout.tp
        comm += layers * 3 * (layout.cp - 1) * (kv / _bandwidth(cluster, layout.tp * layout.cp) + lat)
    if s.num_experts and layout.ep > 1:
        routed = tokens * s.moe_router_topk * s.hidden_size * dt
        span = layout.tp * layout.cp * layout.ep
        comm += layers * 4 * ((layout.ep - 1) / layout.ep * routed / _bandwidth(cluster, span) + lat)
    if layout.pp > 1:
        span = layout.tp * layout.cp * layout.dp * 2
        comm += 2 * layout.chunks * (activation / layout.tp / _bandwidth(cluster, span) + lat)
    swap_s = 0.0
    if layout.swap_attention:
        copies = 2 * swapped / (cluster.host_gbps * 1e9)  # out in the forward, back in the backward
        per_layer_compute = compute_s / max(1, layers)
        swap_s = layers * (max(0.0, copies - per_layer_compute) if cluster.async_copies else copies)
    microbatches = layout.num_microbatches(job.global_batch_size)
    busy = microbatches * (compute_s + comm + swap_s)
    bubble = (layout.pp - 1) / (microbatches * layout.chunks) * busy if layout.pp > 1 else 0.0
    # Data parallelism: the gradient buffer (fp32 in bf16 runs too) reduced once per step.
    grad_bytes = params_per_rank * 4
    dp_span = layout.tp * layout.cp * layout.dp
    bandwidth = _bandwidth(cluster, dp_span)
    if layout.dp == 1:
        data_parallel = 0.0
    elif layout.distributed_optimizer:  # reduce-scatter the gradients, all-gather the weights
        gather = _ring(params_per_rank * dt, layout.dp, bandwidth)
        data_parallel = (_ring(grad_bytes, layout.dp, bandwidth) + gather) / 2 + 2 * lat
    else:
        data_parallel = _ring(grad_bytes, layout.dp, bandwidth) + lat
    shard = params_per_rank // layout.dp if layout.distributed_optimizer else params_per_rank
    state = 12 if job.precision == "bf16" else 8
    optimizer = shard * (2 * state + 8 + 2 * dt) / memory_rate  # read and write state, read grad and weight
    if layout.swap_optimizer:
        optimizer += 2 * shard * state / (cluster.host_gbps * 1e9)
    if layout.reuse_fp32_param:
        optimizer += shard * 8 / memory_rate  # rebuild and split the masters
    return TimeEstimate(
        compute=microbatches * compute_s,
        communication=microbatches * comm,
        bubble=bubble,
        data_parallel=data_parallel,
        optimizer=optimizer,
        swap=microbatches * swap_s,
    )
