"""QLoRA: NF4 base weights in megatron linears equal LoRA over the dequantised weights, bit for
bit (logits and factor gradients, TP1 and TP2 with sequence parallelism, fp32 and bf16), stay
within the NF4 error bound of the original weights, and take about a quarter of their bf16 bytes.

One spawned 2-rank gloo group: a TP1 part (each rank the whole tiny Qwen2.5) and a TP2 part.
Each QLoRA model is compared with a LoRA model of the same layout whose base weights are the
QLoRA model's dequantised NF4 weights.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from mindspeed.testing.distributed import run_distributed
from mindspeed_llm.bridges import ParallelLayout, bridge_for_family, megatron_params
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.checkpoint.lora import lora_param
from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
from mindspeed_llm.training.lora import LORA_TARGETS, LoraSettings

R, ALPHA, VOCAB, BATCH, SEQ = 4, 8.0, 131, 2, 12
#: Half the widest gap between neighbouring NF4 values (-1 and -0.696): the rounding bound.
NF4_HALF_GAP = 0.15191


def _shape(hf: Path):
    from transformers import AutoConfig

    return bridge_for_family("qwen25").shape_from_hf(AutoConfig.from_pretrained(hf).to_dict())


def _factors(shape) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for param in megatron_params(shape).values():
        if param.name.endswith(".weight") and param.module.rsplit(".", 1)[-1] in LORA_TARGETS:
            for which in "AB":
                lp = lora_param(param, which, R)
                out[lp.name] = torch.randn(lp.shape, generator=gen) * 0.1
    return out


def _pair(mg_dir: str, layout: ParallelLayout, shape, factors, settings: LoraSettings, **overrides):
    """A QLoRA model and a LoRA model whose base weights are the QLoRA model's dequantised ones."""
    from megatron.core import parallel_state as ps

    from mindspeed_llm.bridges import RankKey
    from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
    from mindspeed_llm.checkpoint.megatron_legacy import iteration_dir, rank_dir
    from mindspeed_llm.testing.megatron_logits import REFERENCE_IMPLS
    from mindspeed_llm.training.lora import apply_lora, set_lora_factors
    from mindspeed_llm.training.qlora import NF4Linear, apply_qlora

    key = RankKey(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), 0)
    state = torch.load(
        Path(mg_dir) / iteration_dir(1) / rank_dir(key, layout) / "model_optim_rng.pt",
        map_location="cpu",
        weights_only=False,
    )["model"]
    models = []
    for qlora in (True, False):
        model = build_gpt_chunks(shape, layout, REFERENCE_IMPLS, **overrides)[0]
        model.load_state_dict(state, strict=True)
        (apply_qlora if qlora else apply_lora)(model, LoraSettings(**{**vars(settings), "qlora": qlora}))
        set_lora_factors(model, factors)
        models.append(model)
    quantized, plain = models
    original = dict(plain.named_parameters())
    errors = []
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, NF4Linear):
                weight = original[f"{name}.weight"]
                dequantized = module.dequantized_weight(torch.float32)
                blockmax = weight.reshape(-1, 64).abs().amax(dim=1, keepdim=True)
                bound = NF4_HALF_GAP * blockmax + 0.01 * blockmax.max()  # rounding + 8-bit absmax error
                errors.append(bool(((dequantized - weight).reshape(-1, 64).abs() <= bound).all()))
                weight.copy_(dequantized)
    return quantized, plain, errors


def _forward_backward(model, tokens, cotangent, dtype=torch.float32) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens, torch.arange(SEQ).unsqueeze(0), None, runtime_gather_output=True)
    (logits[..., :VOCAB].float() * cotangent).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def _equal(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and sorted(a[1]) == sorted(b[1]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _run_tp1(paths, shape, factors, tokens, cotangent) -> dict:
    from mindspeed.metrics.memory import measure_peak_memory
    from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
    from mindspeed_llm.testing.megatron_logits import REFERENCE_IMPLS, destroy_layout, init_layout
    from mindspeed_llm.training.qlora import NF4_BUFFERS, NF4Linear, apply_qlora, quantized_bytes

    init_layout(ParallelLayout(), shape)
    try:
        quantized, plain, errors = _pair(
            paths["mg_tp1"], ParallelLayout(), shape, factors, LoraSettings(r=R, alpha=ALPHA)
        )
        out = {
            "within_bound": all(errors) and len(errors) == 16,
            "fp32_equal": _equal(
                _forward_backward(quantized, tokens, cotangent), _forward_backward(plain, tokens, cotangent)
            ),
        }
        nf4 = [m for m in quantized.modules() if isinstance(m, NF4Linear)]
        bf16_bytes = sum(2 * torch.Size(m.nf4_shape).numel() for m in nf4)
        out["ratio"] = quantized_bytes(quantized) / bf16_bytes
        keys = quantized.state_dict().keys()
        out["no_base_keys"] = not any(
            k.endswith(tuple(f"{t}.weight" for t in LORA_TARGETS)) or "nf4_" in k for k in keys
        )
        out["lora_sharded"] = sum(".lora_" in k for k in quantized.sharded_state_dict()) == 32
        # Float16Module casts with .bfloat16(): the NF4 state keeps its dtypes and values.
        before = {n: b.clone() for n, b in nf4[0].named_buffers(recurse=False) if n in NF4_BUFFERS}
        quantized.bfloat16()
        plain.bfloat16()
        out["state_kept"] = all(torch.equal(before[n], getattr(nf4[0], n)) for n in before)
        static = {
            label: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
            for label, m in (("qlora", quantized), ("lora", plain))
        }
        peaks = {}
        for label, model in (("qlora", quantized), ("lora", plain)):
            with measure_peak_memory("dispatch") as peak:
                result = _forward_backward(model, tokens, cotangent)
            peaks[label] = peak.peak_bytes
            out[f"bf16_{label}"] = result
        out["bf16_equal"] = _equal(out.pop("bf16_qlora"), out.pop("bf16_lora"))
        out["static"], out["peak"] = static, peaks
        out["bf16_bytes"], out["largest"] = bf16_bytes, max(torch.Size(m.nf4_shape).numel() for m in nf4)
        # qlora_all_linears: LoRA on linear_qkv only, every decoder linear in NF4.
        apply_all = LoraSettings(r=R, alpha=ALPHA, target_modules=("linear_qkv",), qlora=True, qlora_all_linears=True)
        model = build_gpt_chunks(shape, ParallelLayout(), REFERENCE_IMPLS)[0]
        apply_qlora(model, apply_all)
        kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, NF4Linear)})
        out["all_linears"] = kinds == ["LoraNF4ColumnParallelLinear", "NF4ColumnParallelLinear", "NF4RowParallelLinear"]
        out["all_linears_count"] = sum(isinstance(m, NF4Linear) for m in model.modules())
        return out
    finally:
        destroy_layout()


def _run_tp2(paths, shape, factors, tokens, cotangent) -> dict:
    from mindspeed_llm.testing.megatron_logits import destroy_layout, init_layout

    layout = ParallelLayout(tp=2)
    init_layout(layout, shape)
    try:
        quantized, plain, errors = _pair(
            paths["mg_tp2"], layout, shape, factors, LoraSettings(r=R, alpha=ALPHA), sequence_parallel=True
        )
        return {
            "within_bound": all(errors) and len(errors) == 16,
            "equal": _equal(
                _forward_backward(quantized, tokens, cotangent), _forward_backward(plain, tokens, cotangent)
            ),
        }
    finally:
        destroy_layout()


def _rank_main(rank: int, world_size: int, paths: dict, factors, tokens, cotangent) -> bytes:
    from mindspeed.megatron import adapt, unadapt

    adapt("cpu")
    try:
        shape = _shape(Path(paths["hf"]))
        out = {
            "tp1": _run_tp1(paths, shape, factors, tokens, cotangent),
            "tp2": _run_tp2(paths, shape, factors, tokens, cotangent),
        }
    finally:
        unadapt()
    buffer = io.BytesIO()  # tensors through the result queue would be shared-memory handles
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.mark.distributed
def test_qlora_equals_lora_over_dequantised_weights(tmp_path) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("qwen25", hf)
    shape = _shape(hf)
    paths = {"hf": str(hf)}
    for label, tp in (("mg_tp1", 1), ("mg_tp2", 2)):
        paths[label] = str(tmp_path / label)
        convert_checkpoint(
            ConvertConfig(load_dir=hf, save_dir=tmp_path / label, target_tensor_parallel_size=tp, progress=False)
        )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    cotangent = torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    ranks = [
        torch.load(io.BytesIO(raw), weights_only=False)
        for raw in run_distributed(_rank_main, 2, paths, _factors(shape), tokens, cotangent, timeout=300)
    ]
    for result in ranks:
        tp1, tp2 = result["tp1"], result["tp2"]
        assert tp1["within_bound"] and tp2["within_bound"], "dequantised weights outside the NF4 error bound"
        assert tp1["fp32_equal"] and tp1["bf16_equal"] and tp2["equal"], (
            "QLoRA differs from LoRA over the dequantised weights"
        )
        assert 0.25 <= tp1["ratio"] <= 0.27, tp1["ratio"]
        assert tp1["no_base_keys"] and tp1["lora_sharded"] and tp1["state_kept"]
        assert tp1["all_linears"] and tp1["all_linears_count"] == 4 * shape.num_layers
        # bf16 model bytes drop by ~3/4 of the quantised weights' bf16 bytes; a forward + backward
        # dequantises one weight at a time (~8 bytes per value: int32 indices, fp32 values, bf16
        # output) and keeps none for the backward, where saving them would cost 2 bytes per value
        # of every weight.
        static, peak = tp1["static"], tp1["peak"]
        print(
            f"\nQLoRA bf16 static {static}, forward+backward peak {peak}, quantised weights {tp1['bf16_bytes']} "
            f"bf16 bytes, ratio {tp1['ratio']:.4f}"
        )
        assert static["lora"] - static["qlora"] >= 0.7 * tp1["bf16_bytes"], static
        assert peak["qlora"] - peak["lora"] <= 9 * tp1["largest"] < tp1["bf16_bytes"], (peak, tp1["largest"])
