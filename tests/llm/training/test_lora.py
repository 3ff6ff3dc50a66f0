"""LoRA on megatron-core: the same logits as peft on the transformers model, the same factor
gradients at TP1, TP2 (sequence parallel, megatron DDP + finalize_model_grads) and PP2 x VPP, and
adapters that convert-ckpt merges and peft loads to the same logits.

One spawned 2-rank gloo group runs three layouts of a tiny Qwen2.5 (q/k/v biases, tied
embeddings, a vocabulary TP2 pads) with the same non-zero factors: TP1 (each rank the whole
model), TP2 with sequence parallelism wrapped in megatron's DistributedDataParallel, and PP2
with two virtual stages per rank through megatron's interleaved pipeline schedule. The
references come from the parent: transformers + peft with the same factors exported by the
checkpoint converter (tests/llm/checkpoint/test_lora.py proves that path against merged weights).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mindspeed.testing.distributed import run_distributed
from mindspeed_llm.bridges import ParallelLayout, bridge_for_family, megatron_params
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.checkpoint.lora import lora_param, write_lora_checkpoint
from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
from mindspeed_llm.training.lora import LORA_TARGETS, LoraSettings, apply_lora

R, ALPHA, VOCAB, BATCH, SEQ = 4, 8.0, 131, 2, 12
_FACTOR = re.compile(r"^(decoder\.layers\.)(\d+)(\..+)\.lora_([AB])\.default\.weight$")


def _shape(hf: Path):
    from transformers import AutoConfig

    return bridge_for_family("qwen25").shape_from_hf(AutoConfig.from_pretrained(hf).to_dict())


def _reference_factors(shape) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    factors = {}
    for param in megatron_params(shape).values():
        if param.name.endswith(".weight") and param.module.rsplit(".", 1)[-1] in LORA_TARGETS:
            for which in "AB":
                lp = lora_param(param, which, R)
                factors[lp.name] = torch.randn(lp.shape, generator=gen) * 0.1
    return factors


def _full_tensors(chunks, shape, getter) -> dict[str, torch.Tensor]:
    """Every LoRA factor (or its gradient) of the model, unsharded, on every rank: pieces are
    all-gathered over TP and glued with the converter's rules, stages exchanged as objects."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    params, group = megatron_params(shape), ps.get_tensor_model_parallel_group()
    local = {}
    for chunk in chunks:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        numbers = [layer.layer_number - 1 for layer in chunk.decoder.layers]
        for name, param in chunk.named_parameters():
            match = _FACTOR.match(name)
            if not match:
                continue
            module = f"{match[1]}{numbers[int(match[2])]}{match[3]}"
            factor = lora_param(params[f"{module}.weight"], match[4], R)
            value = getter(param).detach().contiguous()
            pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, value, group=group)
            from mindspeed_llm.bridges import merge_tensors

            local[factor.name] = merge_tensors(factor, pieces)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return {k: v for part in everyone for k, v in part.items()}


def _legacy_chunks(mg_dir: str, layout: ParallelLayout, shape, **overrides) -> list:
    from megatron.core import parallel_state as ps

    from mindspeed_llm.bridges import RankKey
    from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
    from mindspeed_llm.checkpoint.megatron_legacy import iteration_dir, model_keys, rank_dir
    from mindspeed_llm.testing.megatron_logits import REFERENCE_IMPLS

    chunks = build_gpt_chunks(shape, layout, REFERENCE_IMPLS, **overrides)
    key = RankKey(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), 0)
    state = torch.load(
        Path(mg_dir) / iteration_dir(1) / rank_dir(key, layout) / "model_optim_rng.pt",
        map_location="cpu",
        weights_only=False,
    )
    for chunk, name in zip(chunks, model_keys(len(chunks))):
        chunk.load_state_dict(state[name], strict=True)
    return chunks


@contextlib.contextmanager
def _synchronous_dist_save():
    """What the trainer's checkpointing does around dist_checkpointing.save in a spawned rank:
    results through a local queue (no Manager process), writer children allowed."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    process, saved = multiprocessing.current_process(), filesystem_async._results_queue
    daemon, process.daemon = process.daemon, False
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue, process.daemon = saved, daemon


def _loss(logits: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    return (logits[..., :VOCAB].float() * cotangent).sum()


def _trainable_is_lora_only(chunk) -> bool:
    names = [n for n, p in chunk.named_parameters() if p.requires_grad]
    return bool(names) and all(_FACTOR.match(n) for n in names) and len(names) == 2 * 4 * len(chunk.decoder.layers)


def _run_tp1(paths: dict, shape, factors, tokens, cotangent) -> dict:
    from mindspeed_llm.testing.megatron_logits import destroy_layout, init_layout, load_rank_chunks
    from mindspeed_llm.training.lora import set_lora_factors

    init_layout(ParallelLayout(), shape)
    try:
        chunk = load_rank_chunks(paths["mg_tp1"])[0]
        names = apply_lora(chunk, LoraSettings(r=R, alpha=ALPHA))
        set_lora_factors(chunk, factors)
        logits = chunk(tokens, torch.arange(SEQ).unsqueeze(0), None)
        _loss(logits, cotangent).backward()
        grads = _full_tensors([chunk], shape, lambda p: p.grad)
        # Dropout: a training forward draws masks, evaluation is deterministic and mask-free.
        for layer in (m for m in chunk.modules() if hasattr(m, "lora_dropout_p")):
            layer.lora_dropout_p = 0.5
        with torch.no_grad():
            chunk.eval()
            evaluated = chunk(tokens, torch.arange(SEQ).unsqueeze(0), None)
            chunk.train()
            dropped = chunk(tokens, torch.arange(SEQ).unsqueeze(0), None)
        return {
            "names": len(names),
            "trainable": _trainable_is_lora_only(chunk),
            "logits": logits.detach(),
            "grads": grads,
            "eval_same": torch.equal(evaluated, logits.detach()),
            "dropout_moves": (dropped - evaluated).abs().max().item(),
        }
    finally:
        destroy_layout()


def _run_tp2_sequence_parallel(paths: dict, shape, factors, tokens, cotangent) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from mindspeed_llm.testing.megatron_logits import destroy_layout, init_layout
    from mindspeed_llm.training.lora import set_lora_factors
    from mindspeed_llm.training.lora_io import export_peft, save_lora_adapter

    layout = ParallelLayout(tp=2)
    settings = LoraSettings(r=R, alpha=ALPHA)
    init_layout(layout, shape)
    try:
        gpt = _legacy_chunks(paths["mg_tp2"], layout, shape, sequence_parallel=True)[0]
        with _synchronous_dist_save():
            dist_checkpointing.save({"model": gpt.sharded_state_dict()}, paths["base_ckpt"])
        apply_lora(gpt, settings)
        set_lora_factors(gpt, factors)
        ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
        lora_params = {id(p) for n, p in gpt.named_parameters() if _FACTOR.match(n)}
        logits = ddp(tokens, torch.arange(SEQ).unsqueeze(0), None, runtime_gather_output=True)
        _loss(logits, cotangent).backward()
        finalize_model_grads([ddp])
        grads = _full_tensors([ddp], shape, lambda p: p.main_grad)
        with _synchronous_dist_save():
            dist_checkpointing.save({"model": gpt.sharded_state_dict()}, paths["lora_ckpt"])
        save_lora_adapter([ddp], paths["adapter_tp2"], shape, None, settings)
        export_peft([ddp], paths["peft"], shape, paths["hf"], settings)
        return {
            "trainable": _trainable_is_lora_only(gpt),
            "ddp_params_are_lora": {id(p) for p in ddp.params_with_grad} == lora_params,
            "logits": logits.detach(),
            "grads": grads,
        }
    finally:
        destroy_layout()


def _run_pp2_vpp(paths: dict, shape, factors, tokens, cotangent) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
    from mindspeed_llm.testing.megatron_logits import REFERENCE_IMPLS, destroy_layout, init_layout, load_rank_chunks
    from mindspeed_llm.training.lora import set_lora_factors, split_lora_state
    from mindspeed_llm.training.lora_io import save_lora_adapter

    layout = ParallelLayout(pp=2, vpp_layers=1)  # two chunks of one layer per rank, interleaved schedule
    settings = LoraSettings(r=R, alpha=ALPHA)

    def lora_chunks(chunks: list, **options) -> list:
        for chunk in chunks:
            apply_lora(chunk, LoraSettings(**{**vars(settings), **options}))
        return chunks

    def state_dicts(chunks: list) -> list:
        return [{n: t for n, t in c.state_dict().items() if isinstance(t, torch.Tensor)} for c in chunks]

    init_layout(layout, shape)
    try:
        chunks = lora_chunks(load_rank_chunks(paths["mg_pp2"]))
        for chunk in chunks:
            set_lora_factors(chunk, factors)
        kept = []

        def forward_step(data_iterator, model):
            batch, cot = next(data_iterator)
            output = model(batch, torch.arange(SEQ).unsqueeze(0), None)

            def loss_func(out):
                kept.append(out.detach().clone())
                return _loss(out, cot) * BATCH, {}  # the schedule divides by the microbatch count

            return output, loss_func

        micro = [(tokens[i : i + 1], cotangent[i : i + 1]) for i in range(BATCH)]
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in chunks],
            model=chunks,
            num_microbatches=BATCH,
            seq_length=SEQ,
            micro_batch_size=1,
            forward_only=False,
        )
        grads = _full_tensors(chunks, shape, lambda p: p.grad)
        save_lora_adapter(chunks, paths["adapter_pp2"], shape, None, settings)
        # The TP2 dist checkpoint (base + LoRA) restores here into a model of other weights.
        fresh = lora_chunks(build_gpt_chunks(shape, layout, REFERENCE_IMPLS), seed=99)
        loaded = dist_checkpointing.load(
            {f"model{i}": c.sharded_state_dict() for i, c in enumerate(fresh)}, paths["lora_ckpt"]
        )
        for i, chunk in enumerate(fresh):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
        restored = _full_tensors(fresh, shape, lambda p: p)
        want = state_dicts(chunks)
        same_base = all(torch.equal(a[n], b[n]) for a, b in zip(want, state_dicts(fresh)) for n in a)
        # A checkpoint saved without LoRA loads into a LoRA model: only the factors are missing.
        plain = lora_chunks(build_gpt_chunks(shape, layout, REFERENCE_IMPLS))
        parts = [split_lora_state(c.sharded_state_dict()) for c in plain]
        loaded = dist_checkpointing.load({f"model{i}": base for i, (base, _) in enumerate(parts)}, paths["base_ckpt"])
        base_loads = True
        for i, (chunk, (_, lora_part)) in enumerate(zip(plain, parts)):
            result = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
            base_loads &= sorted(result.missing_keys) == sorted(lora_part) and not result.unexpected_keys
        got = state_dicts(plain)
        base_loads &= all(torch.equal(a[n], b[n]) for a, b in zip(want, got) for n in a if not _FACTOR.match(n))
        return {
            "trainable": all(_trainable_is_lora_only(c) for c in chunks),
            "logits": torch.cat(kept) if kept else None,
            "grads": grads,
            "restored": restored,
            "restored_base": same_base,
            "base_loads": base_loads,
            "last_stage": bool(kept),
        }
    finally:
        destroy_layout()


def _rank_main(rank: int, world_size: int, paths: dict, factors, tokens, cotangent) -> dict:
    from mindspeed.megatron import adapt, unadapt

    adapt("cpu")
    try:
        shape = _shape(Path(paths["hf"]))
        out = {
            "tp1": _run_tp1(paths, shape, factors, tokens, cotangent),
            "tp2": _run_tp2_sequence_parallel(paths, shape, factors, tokens, cotangent),
            "pp2": _run_pp2_vpp(paths, shape, factors, tokens, cotangent),
        }
    finally:
        unadapt()
    # Tensors through the result queue would travel as shared-memory handles that die with the rank.
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def _hf_logits(path: Path, tokens: torch.Tensor, adapter: Path | None = None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    return model, model(tokens).logits


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.distributed
def test_lora_layouts_peft_and_adapters(tmp_path) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("qwen25", hf)
    shape = _shape(hf)
    paths = {"hf": str(hf)}
    for label, options in (
        ("mg_tp1", {}),
        ("mg_tp2", {"target_tensor_parallel_size": 2}),
        ("mg_pp2", {"target_pipeline_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}),
    ):
        paths[label] = str(tmp_path / label)
        convert_checkpoint(ConvertConfig(load_dir=hf, save_dir=tmp_path / label, progress=False, **options))
    for label in ("base_ckpt", "lora_ckpt"):
        (tmp_path / label).mkdir()
        paths[label] = str(tmp_path / label)
    for label in ("adapter_tp2", "adapter_pp2", "peft"):
        paths[label] = str(tmp_path / label)
    factors = _reference_factors(shape)
    # The reference adapter, written and exported by the checkpoint converter.
    write_lora_checkpoint(tmp_path / "ref_lora", shape, ParallelLayout(), factors, R, ALPHA)
    convert_checkpoint(
        ConvertConfig(
            load_model_type="mg",
            save_model_type="hf",
            load_dir=tmp_path / "mg_tp1",
            save_dir=tmp_path / "ref_peft",
            lora_load=tmp_path / "ref_lora",
            save_lora_to_hf=True,
            progress=False,
        )
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    cotangent = torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    _, base_logits = _hf_logits(hf, tokens)
    peft_model, peft_logits = _hf_logits(hf, tokens, tmp_path / "ref_peft")
    _loss(peft_logits, cotangent).backward()
    peft_grads = dict(peft_model.named_parameters())

    ranks = [
        torch.load(io.BytesIO(raw), weights_only=False)
        for raw in run_distributed(_rank_main, 2, paths, factors, tokens, cotangent, timeout=300)
    ]

    tp1, tp2, pp2 = ranks[0]["tp1"], ranks[0]["tp2"], next(r["pp2"] for r in ranks if r["pp2"]["last_stage"])
    assert tp1["names"] == 16 and all(r[k]["trainable"] for r in ranks for k in ("tp1", "tp2", "pp2"))
    assert tp2["ddp_params_are_lora"], "megatron DDP must hold exactly the LoRA factors"
    # Logits: every layout equals peft on the transformers model.
    assert _close(peft_logits, base_logits) > 1e-2, "the adapter must change the model"
    for label, run in (("tp1", tp1), ("tp2+sp", tp2), ("pp2+vpp", pp2)):
        assert _close(run["logits"][..., :VOCAB], peft_logits) < 1e-5, label
    # Factor gradients: TP2 (after finalize_model_grads) and PP2 equal TP1; TP1 equals peft where
    # the modules map one to one (o_proj / down_proj; q/k/v and gate/up are fused in megatron).
    assert sorted(tp1["grads"]) == sorted(factors) == sorted(tp2["grads"]) == sorted(pp2["grads"])
    scale = max(g.abs().max().item() for g in tp1["grads"].values())
    for label, run in (("tp2+sp", tp2), ("pp2+vpp", pp2)):
        worst = max(_close(run["grads"][k], tp1["grads"][k]) for k in factors)
        assert worst < 1e-5 * scale, (label, worst, scale)
    for layer in range(shape.num_layers):
        for mg, hf_name in (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc2", "mlp.down_proj")):
            for which in "AB":
                want = peft_grads[f"base_model.model.model.layers.{layer}.{hf_name}.lora_{which}.default.weight"].grad
                got = tp1["grads"][f"decoder.layers.{layer}.{mg}.lora_{which}.default.weight"]
                assert _close(got, want) < 1e-5 * scale, (layer, mg, which)
    # The TP2 dist checkpoint restores the factors (and base) at PP2; a base-only checkpoint loads too.
    assert all(r["pp2"]["restored_base"] and r["pp2"]["base_loads"] for r in ranks)
    assert all(torch.equal(ranks[0]["pp2"]["restored"][k], factors[k]) for k in factors)
    # Saved adapters merge through convert-ckpt into the peft logits; the PEFT export equals the
    # converter's own export of the same factors and loads onto the transformers model.
    for label in ("adapter_tp2", "adapter_pp2"):
        merged = tmp_path / f"merged_{label}"
        convert_checkpoint(
            ConvertConfig(
                load_model_type="mg",
                save_model_type="hf",
                load_dir=tmp_path / "mg_tp2",
                save_dir=merged,
                lora_load=Path(paths[label]),
                progress=False,
            )
        )
        _, logits = _hf_logits(merged, tokens)
        assert _close(logits, peft_logits) < 1e-5, label
    exported, reference = (
        load_file(Path(paths["peft"]) / "adapter_model.safetensors"),
        load_file(tmp_path / "ref_peft" / "adapter_model.safetensors"),
    )
    assert sorted(exported) == sorted(reference) and all(torch.equal(exported[k], reference[k]) for k in reference)
    _, logits = _hf_logits(hf, tokens, Path(paths["peft"]))
    assert _close(logits, tp1["logits"][..., :VOCAB]) < 1e-5
    assert tp1["eval_same"] and tp1["dropout_moves"] > 1e-3


def test_bad_settings_are_clear_errors() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match="q_proj.*known megatron module names: linear_qkv, linear_proj, linear_fc1, linear_fc2"
    ):
        apply_lora(model, LoraSettings(target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="lora_r must be an integer >= 1"):
        apply_lora(model, LoraSettings(r=0))
    with pytest.raises(ValueError, match="lora_dropout must be in"):
        apply_lora(model, LoraSettings(dropout=1.0))
    with pytest.raises(ValueError, match="apply LoRA before wrapping"):
        wrapper = torch.nn.Module()
        wrapper.module = model
        apply_lora(wrapper, LoraSettings())
    with pytest.raises(ValueError, match="call mindspeed_llm.training.qlora.apply_qlora"):
        apply_lora(model, LoraSettings(qlora=True))


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_lora_update_matches_the_unfused_formula(needs: tuple[bool, bool]) -> None:
    """The fused update (one addmm, rank-r backward GEMMs) against ``output + F.linear(p, B) * s``:
    the same output and gradients to fp32 rounding, whichever operands need a gradient."""
    from mindspeed_llm.training.lora import _LoraUpdate

    gen = torch.Generator().manual_seed(0)
    output = torch.randn(37, 2, 96, generator=gen, requires_grad=True)
    partial = torch.randn(37, 2, 8, generator=gen, requires_grad=needs[0])
    b_weight = torch.randn(96, 8, generator=gen, requires_grad=needs[1])
    grad = torch.randn(37, 2, 96, generator=gen)
    inputs = [t for t in (output, partial, b_weight) if t.requires_grad]
    fused = _LoraUpdate.apply(output, partial, b_weight, 2.5)
    unfused = output + torch.nn.functional.linear(partial, b_weight) * 2.5
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-5)
    for got, want in zip(torch.autograd.grad(fused, inputs, grad), torch.autograd.grad(unfused, inputs, grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
