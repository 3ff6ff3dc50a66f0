"""adapt(): megatron-core runs on the CPU, registry-kernel specs equal megatron's own layers,
and unadapt() leaves torch and megatron-core exactly as they were."""

from __future__ import annotations

import types

import pytest
import torch

from mindspeed.device.cuda_shim import DeviceRedirectMode, cuda_api_patches
from mindspeed.megatron.patches import megatron_patches
from mindspeed.patching import PatchError, PatchSet, UpstreamPatch
from mindspeed.testing.distributed import run_distributed


def _snapshot() -> dict[str, int]:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.attention as mattention
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.torch_norm as torch_norm

    watched = {
        "torch.cuda": torch.cuda,
        "torch.cuda.random": torch.cuda.random,
        "torch.Tensor": torch.Tensor,
        "mrandom": mrandom,
        "moe_utils": moe_utils,
        "attention": mattention,
        "WrappedTorchNorm": torch_norm.WrappedTorchNorm,
    }
    snap = {}
    for name, obj in watched.items():
        for attr in dir(obj):
            if not attr.startswith("__"):
                try:
                    value = getattr(obj, attr)
                except Exception:
                    continue
                # Functions and classes only: megatron's own globals (its RNG tracker) change by design.
                if callable(value):
                    snap[f"{name}.{attr}"] = id(value)
    snap["function_modes"] = torch._C._len_torch_function_stack()
    return snap


def _gpt(spec, spec_activation: bool, vocab: int = 128):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_te_activation_func=spec_activation,
        bias_activation_fusion=False,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
    )


def _adapt_roundtrip(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed.device import get_accelerator
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.megatron.spec import get_gpt_layer_spec, rotary_patch
    from mindspeed.patching import PatchSet

    before = _snapshot()
    report = adapt("cpu")
    during = _snapshot()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    ids = torch.randint(0, 128, (2, 24))
    pos = torch.arange(24).unsqueeze(0).expand(2, -1)
    results = {}
    local = _gpt(get_gpt_layer_local_spec(normalization="RMSNorm"), spec_activation=False)
    local_loss = local(ids, pos, None, labels=ids).float().mean()
    local_loss.backward()
    for impl in ("reference", "auto"):
        # The registry rotary (auto: native, computed on heads-major views) against megatron's own.
        rope = PatchSet([rotary_patch(impl)])
        ours = _gpt(
            get_gpt_layer_spec(impls={op: impl for op in ("rms_norm", "attention", "swiglu")}), spec_activation=True
        )
        missing = ours.load_state_dict(local.state_dict(), strict=True)
        rope.apply(get_accelerator())
        try:
            loss = ours(ids, pos, None, labels=ids).float().mean()
            loss.backward()
        finally:
            rope.revert()
        grads = dict(local.named_parameters())
        # dist checkpointing walks every submodule: the registry modules must take part.
        sharded = ours.sharded_state_dict()
        results[impl] = {
            "sharded_ok": len(sharded) >= len(list(ours.parameters())),
            "loss_diff": abs(loss.item() - local_loss.item()),
            "grad_diff": max((p.grad - grads[n].grad).abs().max().item() for n, p in ours.named_parameters()),
            "kinds": sorted({type(m).__name__ for m in ours.modules() if type(m).__name__.startswith("Registry")}),
            "missing": len(missing.missing_keys) + len(missing.unexpected_keys),
        }
    unadapt()
    after = _snapshot()

    # Features drive the spec: the kernels they choose are what get_gpt_layer_spec() builds.
    from mindspeed.features import FeaturesConfig, ModelFacts

    features = FeaturesConfig(
        optimization_level=2, settings={"fused_rotary_pos_emb": {"enabled": True, "impl": "reference"}}
    )
    report = adapt("cpu", features=features, model=ModelFacts.from_transformer_config(local.config))
    ours = _gpt(get_gpt_layer_spec(report.kernels), spec_activation=True)
    ours.load_state_dict(local.state_dict(), strict=True)
    featured_loss = ours(ids, pos, None, labels=ids).float().mean()
    chosen = {type(m).__name__: m.kernel.name for m in ours.modules() if type(m).__name__.startswith("Registry")}
    ctx_kernels = dict(report.kernels)
    featured_patches = [p.name for p in report.patches]
    unadapt()
    parallel_state.destroy_model_parallel()
    return {
        "featured": {
            "loss_diff": abs(featured_loss.item() - local_loss.item()),
            "chosen": chosen,
            "ctx": ctx_kernels,
            "patches": featured_patches,
        },
        "restored_after_features": sorted(k for k in before if _snapshot().get(k) != before[k]),
        "results": results,
        "patched": sorted(k for k in before if during.get(k) != before[k]),
        "restored": sorted(k for k in before if after.get(k) != before[k]),
        "report_patches": [p.name for p in report.patches],
        "device_redirect": report.device_redirect,
    }


@pytest.mark.distributed
def test_adapt_runs_megatron_and_unadapt_restores_everything() -> None:
    (out,) = run_distributed(_adapt_roundtrip, 1, timeout=240)
    assert out["device_redirect"] is True
    assert "torch.cuda.current_device" in out["patched"] and "mrandom._get_cuda_rng_state" in out["patched"]
    assert "function_modes" in out["patched"]
    assert out["restored"] == [], f"not restored by unadapt(): {out['restored']}"
    assert {"rng-get", "distopt-state-keys", "cuda-api:current_device"} <= set(out["report_patches"])
    featured = out["featured"]
    assert featured["loss_diff"] < 1e-5
    assert "rotary-pos-emb-kernel" in featured["patches"] and featured["ctx"]["rotary_pos_emb"] == "reference"
    assert featured["chosen"] == {
        "RegistryNorm": featured["ctx"]["rms_norm"],
        "RegistryAttention": featured["ctx"]["attention"],
        "RegistrySwiGLU": featured["ctx"]["swiglu"],
    }
    assert out["restored_after_features"] == []
    for impl, row in out["results"].items():
        assert row["kinds"] == ["RegistryAttention", "RegistryNorm", "RegistrySwiGLU"], impl
        assert row["missing"] == 0
        assert row["sharded_ok"], (impl, row)
        assert row["loss_diff"] < 1e-5, (impl, row)
        assert row["grad_diff"] < 1e-5, (impl, row)


def test_registry_rotary_returns_heads_major_memory() -> None:
    """The patched rotary gives megatron's values in [s, b, n, d] with the memory of [b, n, s, d]
    (what attention reads queries and keys in); gradients equal the reference's."""
    from mindspeed.megatron.spec import _rotary
    from mindspeed.ops.rotary import rotary_pos_emb_reference

    config = types.SimpleNamespace(multi_latent_attention=False, apply_rope_fusion=False, rotary_interleaved=False)
    rotate = _rotary(None, None, "native")
    x = torch.randn(6, 2, 3, 8, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 8)
    out = rotate(x, freqs, config)
    assert out.shape == x.shape and out.permute(1, 2, 0, 3).is_contiguous()
    ref = rotary_pos_emb_reference(x, torch.cos(freqs), torch.sin(freqs))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(ref, x, grad)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_registry_rotary_on_packed_tokens_equals_megatron_thd() -> None:
    """Packed (thd) tokens with one table row per token (megatron's "exact mapping", what shared-prefix
    packing gathers) take the registry kernel: values and gradients equal megatron's THD rope; a table
    of segment positions (one row per position, not per token) and context parallelism stay with megatron."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from mindspeed.megatron.spec import _rotary

    config = types.SimpleNamespace(multi_latent_attention=False, apply_rope_fusion=False, rotary_interleaved=False)
    cp1 = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs["cu_seqlens"])
        return apply_rotary_pos_emb(*args, **kwargs)

    rotate = _rotary(original, None, "native")
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    positions = torch.cat([torch.arange(5), torch.arange(3, 10), torch.arange(4)])
    table = torch.randn(10, 1, 1, 8, generator=gen)
    freqs = table[positions]  # [T, 1, 1, d]: per token
    x = torch.randn(16, 3, 8, generator=gen, requires_grad=True)
    out = rotate(x, freqs, config, cu_seqlens=cu, cp_group=cp1)
    assert not calls, "the exact-mapping case went to megatron's THD rope"
    want = apply_rotary_pos_emb(x, freqs, config, cu_seqlens=cu, cp_group=cp1)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    grad = torch.randn(out.shape, generator=gen)
    (got,) = torch.autograd.grad(out, x, grad)
    (ref,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    # A wrong table (segment positions from 0) would move the values: the test sees the mapping.
    assert (
        rotate(x, table[torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])], config, cu, cp_group=cp1) - out
    ).abs().max() > 1e-3
    rotate(x, table, config, cu_seqlens=cu, cp_group=cp1)  # [max_s] rows: megatron numbers each segment
    cp2 = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    try:
        rotate(x, freqs, config, cu_seqlens=cu, cp_group=cp2)
    except Exception:  # megatron's CP split of these odd lengths may refuse; what matters is who was asked
        pass
    assert len(calls) == 2, calls


# -- the patch machinery itself, on a stand-in module (no megatron, no devices) --------------


def _fake_module(monkeypatch):
    mod = types.ModuleType("fake_upstream")
    mod.func = lambda: "original"

    class Owner:
        def method(self):
            return "original"

    mod.Owner = Owner
    monkeypatch.setitem(__import__("sys").modules, "fake_upstream", mod)
    return mod


def test_patch_applies_reverts_and_checks_versions(monkeypatch) -> None:
    mod = _fake_module(monkeypatch)
    acc = types.SimpleNamespace(name="cpu")
    good = UpstreamPatch(
        "f", "fake_upstream.func", lambda orig, a: lambda: "patched:" + orig(), "torch", ">=2.0", "test"
    )
    method = UpstreamPatch(
        "m", "fake_upstream.Owner.method", lambda orig, a: lambda self: "patched", "torch", ">=2.0", "test"
    )
    added = UpstreamPatch(
        "a", "fake_upstream.new_attr", lambda orig, a: 42, "torch", ">=2.0", "test", allow_missing=True
    )
    patches = PatchSet([good, method, added])
    records = patches.apply(acc)
    assert [r.name for r in records] == ["f", "m", "a"]
    assert mod.func() == "patched:original" and mod.Owner().method() == "patched" and mod.new_attr == 42
    patches.revert()
    assert mod.func() == "original" and mod.Owner().method() == "original" and not hasattr(mod, "new_attr")
    old = UpstreamPatch("o", "fake_upstream.func", lambda orig, a: None, "torch", "<1.0", "test")
    with pytest.raises(PatchError, match=r"targets torch<1.0 but .* is installed"):
        old.apply(acc)
    gone = UpstreamPatch("g", "fake_upstream.gone", lambda orig, a: None, "torch", ">=2.0", "test")
    failing = PatchSet([good, gone])
    with pytest.raises(PatchError, match="does not exist"):
        failing.apply(acc)
    assert mod.func() == "original", "a failed PatchSet must revert what it applied"


def test_adaptor_refuses_megatron_outside_range(monkeypatch) -> None:
    from packaging.version import Version

    from mindspeed.megatron import adaptor

    monkeypatch.setattr(adaptor, "installed_version", lambda dist: Version("0.99.0"))
    with pytest.raises(PatchError, match=r"megatron-core 0.99.0 is installed but the adaptor supports >=0.16.0,<0.17"):
        adaptor.check_megatron_version()


def test_installed_megatron_is_in_every_patch_range() -> None:
    for patch in [*cuda_api_patches(), *megatron_patches()]:
        patch.check_version()  # fails when a dependency upgrade moves outside a patch's range


class _FakeNpu:
    """Stands in for the NPU accelerator: torch_npu is absent here, the patch logic is not."""

    name = "npu"

    def device(self, index=None):
        return f"npu:{0 if index is None else index}"


def test_npu_path_selection_and_redirects() -> None:
    npu = _FakeNpu()
    applied = [p.name for p in [*cuda_api_patches(), *megatron_patches()] if p.applies_to("npu")]
    assert "cuda-api:current_device" in applied and "rng-get" in applied and "moe-splits-to-host" in applied
    on_cuda = [p.name for p in [*cuda_api_patches(), *megatron_patches()] if p.applies_to("cuda")]
    assert not any(name.startswith(("cuda-api:", "rng-")) for name in on_cuda), "CUDA must stay untouched"
    mode = DeviceRedirectMode(npu)
    assert mode.map_device("cuda") == "npu:0"
    assert mode.map_device("cuda:3") == "npu:3"
    assert mode.map_device(torch.device("cuda", 2)) == "npu:2"
    assert mode.map_device(1) == "npu:1"
    assert mode.map_device("cpu") == "cpu" and mode.map_device(True) is True


def test_stream_and_event_redirects_stay_types() -> None:
    import typing

    from mindspeed.device import get_accelerator

    patches = PatchSet([p for p in cuda_api_patches() if p.name in ("cuda-api:Stream", "cuda-api:Event")])
    patches.apply(get_accelerator())
    try:
        assert isinstance(torch.cuda.Stream, type) and isinstance(torch.cuda.Event, type)
        typing.Optional[torch.cuda.Stream]  # noqa: UP045  transformers annotates with it at import time
        stream, event = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(stream)
        event.record()
    finally:
        patches.revert()
    assert torch.cuda.Stream.__module__.startswith("torch")


def test_cpu_redirect_mode_rewrites_cuda_arguments() -> None:
    from mindspeed.device import get_accelerator

    with DeviceRedirectMode(get_accelerator()):
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2).cuda()
        z = torch.ones(2).to("cuda:0")
        name = torch.ones(2).type()
        pinned = torch.tensor([1, 2], pin_memory=True)  # megatron's CP rope slice asks for pinning
    assert pinned.tolist() == [1, 2]
    assert x.device.type == y.device.type == z.device.type == "cpu"
    assert name == "torch.cuda.FloatTensor"
    assert torch.ones(2).type() == "torch.FloatTensor"  # only inside the mode


def test_redirect_suspended_leaves_only_the_redirect() -> None:
    import torch
    from torch.overrides import TorchFunctionMode

    from mindspeed.device import get_accelerator
    from mindspeed.device.cuda_shim import DeviceRedirectMode, redirect_suspended

    kind = get_accelerator().device().type
    with redirect_suspended():  # no mode: nothing to do
        assert torch._C._len_torch_function_stack() == 0
    with DeviceRedirectMode(get_accelerator()):
        depth = torch._C._len_torch_function_stack()
        assert torch.zeros(1, device="cuda").device.type == kind
        with redirect_suspended():
            assert torch._C._len_torch_function_stack() == depth - 1
        assert torch._C._len_torch_function_stack() == depth
        assert torch.zeros(1, device="cuda").device.type == kind

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
            return func(*args, **(kwargs or {}))

    with Other():  # another mode on top is never removed
        with redirect_suspended():
            assert torch._C._len_torch_function_stack() == 1
