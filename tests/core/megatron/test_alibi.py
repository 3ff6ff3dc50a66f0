"""ALiBi inside megatron-core, on one spawned group of 2 gloo ranks.

- megatron's ``SelfAttention`` built from the registry spec with ``alibi=True`` (fused QKV and
  output projection with biases, BLOOM's weights loaded, sharded at TP2) equals transformers'
  ``BloomAttention`` forward and input gradient, at TP1 and TP2;
- a tiny ALiBi GPT (6 heads: slopes not all from one power of two) at TP2 equals the single-rank
  run, loss and every gradient: each rank adds the slopes of its own heads;
- Ulysses and ring context parallelism (CP2): each rank's rows of ALiBi attention, and the
  gradients summed over the ranks, equal the single-rank attention (the ring biases each block by
  its rows' and keys' global positions); hybrid CP is refused with one line;
- the shared mask: a packed forward of that GPT builds its attention mask (the ALiBi bias with
  the segments' -inf) once for all 4 layers, and again only for the next microbatch's ``cu_seqlens``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.megatron.config import ParallelSizes, transformer_config
from mindspeed.model.shape import ModelShape
from mindspeed.testing.distributed import run_distributed
from mindspeed.testing.megatron import (
    TinyGPTConfig,
    check_layout,
    destroy_parallel,
    init_parallel,
    make_batches,
    merge_summaries,
    run_reference,
)

HIDDEN, HEADS, SEQ, BATCH = 48, 6, 10, 2
MODEL = TinyGPTConfig(
    num_layers=4, hidden_size=HIDDEN, ffn_hidden_size=96, num_attention_heads=HEADS, position_embedding_type="alibi"
)
#: One BLOOM attention block as a model shape (MHA: BLOOM's fused QKV is megatron's grouped layout).
BLOOM_LAYER = ModelShape(
    num_layers=1,
    hidden_size=HIDDEN,
    ffn_hidden_size=4 * HIDDEN,
    num_attention_heads=HEADS,
    vocab_size=64,
    normalization="LayerNorm",
    swiglu=False,
    add_bias_linear=True,
    add_qkv_bias=True,
    position_embedding_type="alibi",
)


def _bloom_attention(seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' ``BloomAttention`` (random weights) on one input: weights, input, probe,
    output and input gradient. Runs in the parent: the ranks never import transformers (seconds each)."""
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor

    torch.manual_seed(seed)
    bloom = BloomAttention(BloomConfig(hidden_size=HIDDEN, n_head=HEADS), layer_idx=0).eval()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    probe = torch.randn(BATCH, SEQ, HIDDEN)
    alibi = build_alibi_tensor(torch.ones(BATCH, SEQ), HEADS, torch.float32)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    out, _ = bloom(x, torch.zeros_like(x), alibi, causal)
    (out * probe).sum().backward()
    weights = {name: p.detach() for name, p in bloom.named_parameters()}
    return {**weights, "x": x.detach(), "probe": probe, "out": out.detach(), "x_grad": x.grad}


def _bloom_attention_gap(tp: int, bloom: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest |megatron - BloomAttention| of the output and the input gradient, at ``tp``."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mindspeed.megatron.spec import get_gpt_layer_spec

    init_parallel(ParallelSizes(tp=tp))
    try:
        spec = get_gpt_layer_spec(normalization="LayerNorm", swiglu=False, alibi=True)
        layer = TransformerLayer(transformer_config(BLOOM_LAYER, ParallelSizes(tp=tp)), spec.submodules, 1)
        attn, rank = layer.self_attention, ps.get_tensor_model_parallel_rank()
        with torch.no_grad():  # column-parallel QKV rows and row-parallel projection columns of this rank
            attn.linear_qkv.weight.copy_(bloom["query_key_value.weight"].chunk(tp, 0)[rank])
            attn.linear_qkv.bias.copy_(bloom["query_key_value.bias"].chunk(tp, 0)[rank])
            attn.linear_proj.weight.copy_(bloom["dense.weight"].chunk(tp, 1)[rank])
            attn.linear_proj.bias.copy_(bloom["dense.bias"])
        x = bloom["x"].clone().requires_grad_(True)
        out, bias = attn(x.transpose(0, 1).contiguous(), attention_mask=None)
        ours = (out + bias).transpose(0, 1)
        (ours * bloom["probe"]).sum().backward()
    finally:
        destroy_parallel()
    return {
        "output": (ours - bloom["out"]).abs().max().item(),
        "input grad": (x.grad - bloom["x_grad"]).abs().max().item(),
        "output scale": bloom["out"].abs().max().item(),
    }


def _cp_gaps(rank: int) -> dict[str, Any]:
    """Largest |CP2 - single rank| of ALiBi attention rows and input gradients under Ulysses and the
    ring (every block biased by its global positions); hybrid's refusal."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed.megatron.modules import RegistryAttention
    from mindspeed.ops.alibi import get_alibi_slopes
    from mindspeed.ops.attention import attention_reference
    from mindspeed.parallel.context_parallel import RING, shard_ranges

    seq = 16
    torch.manual_seed(1)  # the same full tensors on both ranks; megatron's [s, b, n, d]
    q, k, v = (torch.randn(seq, 1, HEADS, HIDDEN // HEADS, requires_grad=True) for _ in range(3))
    probe = torch.randn(seq, 1, HIDDEN)
    full = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    want = attention_reference(*(t.transpose(0, 1) for t in full), alibi_slopes=get_alibi_slopes(HEADS))
    want = want.transpose(0, 1).reshape(seq, 1, HIDDEN)
    (want * probe).sum().backward()
    rows = torch.cat([torch.arange(a, b) for a, b in shard_ranges(seq, rank, 2, RING)])
    gaps: dict[str, Any] = {"scale": want.abs().max().item()}
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        config = transformer_config(MODEL, ParallelSizes(cp=2))
        for comm, impl in (("a2a", "sdpa"), ("p2p", "auto")):
            attn = RegistryAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type=comm, impl=impl, alibi=True)
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            ours = attn(*(t[rows] for t in leaves), None)
            (ours * probe[rows]).sum().backward()
            grads = [t.grad for t in leaves]
            for grad in grads:
                torch.distributed.all_reduce(grad, group=ps.get_context_parallel_group())
            gaps[comm] = {
                "output": (ours - want[rows]).abs().max().item(),
                "grads": max((g - t.grad).abs().max().item() for g, t in zip(grads, full)),
            }
        try:
            hybrid = transformer_config(MODEL, ParallelSizes(cp=2), hierarchical_context_parallel_sizes=[2, 1])
            RegistryAttention(hybrid, 1, AttnMaskType.causal, "self", cp_comm_type="a2a+p2p", alibi=True)
            gaps["refusal"] = ""
        except ValueError as error:
            gaps["refusal"] = str(error)
    finally:
        ps.destroy_model_parallel()
    return gaps


def _mask_constructions() -> list[tuple[int, int]]:
    """``(built, reused)`` masks of two packed forwards of the ALiBi GPT (a new ``cu_seqlens`` each)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed.ops import mask_cache
    from mindspeed.testing.megatron import build_gpt, unwrap

    init_parallel(ParallelSizes())
    try:
        gpt = unwrap(build_gpt(MODEL, ParallelSizes())[0])
        counts = []
        for lengths in ((3, 7), (6, 4)):
            cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
            mask_cache.clear_masks()
            tokens = torch.randint(0, MODEL.vocab_size, (1, sum(lengths)))
            gpt(tokens, torch.arange(sum(lengths))[None], None, packed_seq_params=packed).sum().backward()
            counts.append((mask_cache.stats["built"], mask_cache.stats["reused"]))
        return counts
    finally:
        destroy_parallel()


def _check(rank: int, world_size: int, bloom: dict[str, torch.Tensor]) -> dict[str, Any]:
    from mindspeed.megatron import adapt, unadapt

    adapt()
    try:
        gaps = {tp: _bloom_attention_gap(tp, bloom) for tp in (1, 2)}
        batches = make_batches(MODEL, 2, 2)
        reference = run_reference(MODEL, batches)
        summary = check_layout(MODEL, ParallelSizes(tp=2), batches, reference, "tp2")
        masks = _mask_constructions()
        cp = _cp_gaps(rank)
    finally:
        unadapt()
    return {"gaps": gaps, "summary": summary, "names": sorted(reference.grads), "masks": masks, "cp": cp}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_check, 2, _bloom_attention(), timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_attention_equals_bloom_attention(results: list[dict[str, Any]], tp: int) -> None:
    for out in results:
        gap = out["gaps"][tp]
        assert gap["output scale"] > 0.1, gap  # not a comparison of near-zero tensors
        assert gap["output"] < 1e-5 and gap["input grad"] < 1e-5, gap


@pytest.mark.distributed
def test_tp2_alibi_gpt_equals_single_rank(results: list[dict[str, Any]]) -> None:
    layout = merge_summaries([[out["summary"]] for out in results])["tp2"]
    assert not layout["failures"], "\n".join(layout["failures"])
    assert layout["names"] == {"loss"} | {f"grad {name}" for name in results[0]["names"]}


@pytest.mark.distributed
def test_one_mask_per_microbatch_shared_by_all_layers(results: list[dict[str, Any]]) -> None:
    # 4 layers: one construction and 3 reuses per forward (per layer it would be 4 constructions).
    assert results[0]["masks"] == [(1, MODEL.num_layers - 1)] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_ulysses_and_ring_cp2_alibi_equal_single_rank(results: list[dict[str, Any]], comm: str) -> None:
    for out in results:
        gaps = out["cp"]
        assert gaps["scale"] > 0.1 and gaps[comm]["output"] < 1e-5 and gaps[comm]["grads"] < 1e-5, gaps
        assert "not hybrid" in gaps["refusal"], gaps["refusal"]
