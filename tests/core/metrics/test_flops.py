"""Model FLOPs from the model description (ModelShape) equal the matmul FLOPs torch counts; the peak table and MFU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mindspeed.device import get_accelerator
from mindspeed.metrics.flops import forward_flops_per_token, training_flops_per_token
from mindspeed.metrics.peak import PEAK_TFLOPS, Peak, cpu_peak, lookup_peak, mfu, peak_flops
from mindspeed.model import ModelShape
from mindspeed.testing.tiny_llama import TinyLlama


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_formula_equals_counted_matmul_flops_forward_and_backward(kv_heads: int) -> None:
    # One description: the model that runs and the formula read the same ModelShape.
    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=kv_heads,
        vocab_size=96,
    )
    torch.manual_seed(0)
    model = TinyLlama(shape, impl="reference")
    batch, seq = 2, 24
    ids = torch.randint(0, shape.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as forward:
        logits = model(ids)
    assert forward.get_total_flops() == forward_flops_per_token(shape, seq) * batch * seq
    with FlopCounterMode(display=False) as both:
        model(ids).sum().backward()
    assert both.get_total_flops() == training_flops_per_token(shape, seq) * batch * seq
    assert logits.shape == (batch, seq, 96)


def test_moe_and_plain_mlp_terms_by_hand() -> None:
    dense = ModelShape(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=16,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        vocab_size=10,
        swiglu=False,
    )
    # qkv 2*8*(8+2*4) + proj 2*8*8 + attention 4*5*8 + mlp 2*8*16*2 + logits 2*8*10
    assert forward_flops_per_token(dense, 5) == 256 + 128 + 160 + 512 + 160
    assert forward_flops_per_token(dense, 5, vocab_size=16) == 256 + 128 + 160 + 512 + 2 * 8 * 16
    moe = ModelShape(
        num_layers=2,
        hidden_size=8,
        ffn_hidden_size=16,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        vocab_size=10,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        moe_layer_freq=(0, 1),
    )
    attention = 256 + 128 + 160
    expert = 2 * 8 * 6 * 3
    assert forward_flops_per_token(moe, 5) == 2 * attention + 2 * 8 * 16 * 3 + (2 * expert + 2 * 8 * 4) + 160
    # a gated shared expert of width 12 adds its MLP and a 2 h gate to the MoE layer
    shared = ModelShape(**{**moe.__dict__, "moe_shared_expert_intermediate_size": 12, "moe_shared_expert_gate": True})
    assert forward_flops_per_token(shared, 5) - forward_flops_per_token(moe, 5) == 2 * 8 * 12 * 3 + 2 * 8


def test_mla_terms_by_hand() -> None:
    # h 8, 2 heads, q rank 4, kv rank 3, nope 2 + rope 1 per head, v 2, s 5, one dense layer
    mla = ModelShape(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=16,
        num_attention_heads=2,
        vocab_size=10,
        multi_latent_attention=True,
        q_lora_rank=4,
        kv_lora_rank=3,
        qk_head_dim=2,
        qk_pos_emb_head_dim=1,
        v_head_dim=2,
    )
    q = 2 * 8 * 4 + 2 * 4 * 2 * 3
    kv = 2 * 8 * (3 + 1) + 2 * 3 * 2 * (2 + 2)
    out = 2 * 2 * 2 * 8
    scores = 2 * 5 * 2 * 3 + 2 * 5 * 2 * 2
    assert forward_flops_per_token(mla, 5) == q + kv + out + scores + 2 * 8 * 16 * 3 + 2 * 8 * 10


# Peaks from the architecture, not from the table: streaming multiprocessors x dense FLOP per clock
# per SM x boost clock (GHz), as the vendors' whitepapers give them. bf16/fp16 run on the tensor
# cores (Hopper 4096, Ampere GA100 2048, GA10x/Ada/Volta 1024 FLOP/clock/SM, no sparsity); fp32 on
# the CUDA cores (2 FLOP per FMA: 128 or 64 cores per SM). (device name as torch reports it,
# dtype, SMs, FLOP/clock/SM, GHz)
ARCHITECTURE = [
    ("NVIDIA H100 80GB HBM3", "bf16", 132, 4096, 1.830),
    ("NVIDIA H100 80GB HBM3", "fp32", 132, 256, 1.980),
    ("NVIDIA H100 PCIe", "bf16", 114, 4096, 1.620),
    ("NVIDIA H100 PCIe", "fp32", 114, 256, 1.755),
    ("NVIDIA A100-SXM4-80GB", "bf16", 108, 2048, 1.410),
    ("NVIDIA A100-SXM4-80GB", "fp32", 108, 128, 1.410),
    ("NVIDIA A10", "bf16", 72, 1024, 1.695),
    ("NVIDIA A10", "fp32", 72, 256, 1.695),
    ("NVIDIA L4", "fp16", 58, 1024, 2.040),
    ("NVIDIA L4", "fp32", 58, 256, 2.040),
    ("Tesla V100-SXM2-32GB", "fp16", 80, 1024, 1.530),
    ("Tesla V100-SXM2-32GB", "fp32", 80, 128, 1.530),
]


@pytest.mark.parametrize(("name", "dtype", "sms", "per_clock", "ghz"), ARCHITECTURE)
def test_peak_table_agrees_with_the_architecture(name: str, dtype: str, sms: int, per_clock: int, ghz: float) -> None:
    peak = lookup_peak(name, dtype)
    assert peak is not None and peak.source
    assert peak.tflops == pytest.approx(sms * per_clock * ghz / 1000, rel=0.01)


def test_every_row_is_reachable_and_names_resolve_to_the_most_specific_row() -> None:
    # A row shadowed by an earlier, shorter fragment ("A10" before "A100") would never be used.
    for row in PEAK_TFLOPS:
        for dtype, tflops in row.tflops.items():
            peak = lookup_peak(f"NVIDIA {row.match} 80GB", dtype)
            assert peak is not None and (peak.tflops, peak.source) == (tflops, row.source), row.match
    assert lookup_peak("NVIDIA H100 PCIe", "bf16").source != lookup_peak("NVIDIA H100 SXM5", "bf16").source
    assert lookup_peak("NVIDIA A100 PCIe", "bf16").tflops != lookup_peak("NVIDIA A10", "bf16").tflops


def test_unknown_device_override_and_mfu() -> None:
    assert lookup_peak("Some Accelerator 9000", "bf16") is None
    assert lookup_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on V100
    peak = peak_flops("bf16", override_tflops=100.0)
    assert peak.source == "override" and "100 TFLOP/s per device" in peak.describe()
    assert mfu(50e12, peak, num_devices=2) == pytest.approx(0.25)
    assert mfu(1.0, None, 1) is None
    tflops, formula = cpu_peak(threads=2)
    assert tflops > 0 and "2 threads" in formula
    if get_accelerator().name == "cpu":  # a host always has its estimate; devices need a table row
        assert isinstance(peak_flops("fp32"), Peak) and peak_flops("fp32").source.startswith("host estimate")
